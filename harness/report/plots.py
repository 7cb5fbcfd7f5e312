"""The report's plots: matplotlib figures as inline SVG, for one HTML file that fetches nothing.

Text is drawn as paths (no font to load), the SVG carries no metadata, and each
figure salts its ids so that several SVGs share a page without their clip paths
and markers colliding. Strings from a run (arm names) reach the SVG only as
glyph paths and escaped comments.

    throughput   aggregate and per-request output tok/s against concurrency, one line an arm
    latency      TTFT and TPOT p50 / p90 / p99 against concurrency
    cdf          TTFT and TPOT of every timed request, one curve an arm
    rates        output tok/s and TTFT percentiles against the offered request rate (open-loop cells)

A point holds the cell's value in each repetition (`harness run all --cell-repeats`): the line runs through their
geometric mean and a band spans their lowest to highest; one value (one burst) draws a point and no band. Legends
sit below the panels, never on the data; every tick label has one size; a figure is as wide as the page.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

matplotlib.use("svg")

_salt = itertools.count()
COLORS = ("#2a5db0", "#b0482a", "#2c8a3b", "#7a3fa0", "#b08a1a", "#3a8f9e", "#555555")
PERCENTILE_STYLES = (("p50", "-"), ("p90", "--"), ("p99", ":"))

# {arm: [(concurrency or offered rate, [the value in each repetition]), ...]}
Series = dict[str, list[tuple[float, list[float | None]]]]
TICK_SIZE = 8
WIDTH_IN, HEIGHT_IN = 11.0, 3.6  # every figure: two panels, the page's width (the template scales it to 100%)


def svg(fig: Figure) -> str:
    """The figure as SVG markup for inlining in HTML (no XML prolog, no metadata)."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": f"fig{next(_salt)}"}):
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _figure(panels: int) -> tuple[Figure, Sequence]:
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, color="#dde2ea", linewidth=0.6)
    return fig, axes


def _finish(fig: Figure, axes: Sequence, styles: bool = False) -> str:
    """Tick labels of one size, then one legend below the panels (the arms' colours; with `styles`, the
    percentiles' line styles too), and the SVG."""
    for ax in axes:
        ax.tick_params(axis="both", which="both", labelsize=TICK_SIZE)
    handles = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if styles:
        for pct, style in PERCENTILE_STYLES:
            handles[pct] = Line2D([], [], color="#333333", linestyle=style, linewidth=1.4)
    if handles:
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="outside lower center",
            ncol=min(len(handles), 6),
            fontsize=TICK_SIZE,
            frameon=False,
        )
    return svg(fig)


_PLAIN = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}")


def _plain_log(axis) -> None:
    """A log axis labelled with plain numbers (1,000, not 10^3), minor ticks too where there is no major one."""
    axis.set_major_formatter(_PLAIN)
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if str(int(v))[0] in "25" and v >= 1 else ""))


def _concurrency_axis(ax, levels: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrent requests", fontsize=9)


def _center(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in kept) / len(kept)) if kept else None


def _lines(ax, series: Series, arms: Sequence[str], style: str = "-", label: bool = True, band: bool = True) -> None:
    """One line an arm through each point's geometric mean, a band from its lowest to its highest repetition."""
    for arm, color in zip(arms, itertools.cycle(COLORS)):
        points = sorted((x, _center(vs), [v for v in vs if v is not None]) for x, vs in series.get(arm, []))
        points = [(x, c, vs) for x, c, vs in points if c is not None]
        if not points:
            continue
        xs = [x for x, _, _ in points]
        ax.plot(
            xs,
            [c for _, c, _ in points],
            style,
            color=color,
            marker="o",
            markersize=4,
            linewidth=1.4,
            label=arm if label else None,
        )
        if band and any(len(vs) > 1 for _, _, vs in points):
            ax.fill_between(
                xs,
                [min(vs) for _, _, vs in points],
                [max(vs) for _, _, vs in points],
                color=color,
                alpha=0.18,
                linewidth=0,
            )


def throughput(aggregate: Series, per_request: Series) -> str | None:
    """Aggregate and per-request output tok/s against concurrency; None without concurrency cells."""
    arms = list(dict.fromkeys([*aggregate, *per_request]))
    levels = sorted({c for s in (aggregate, per_request) for pts in s.values() for c, _ in pts})
    if not levels:
        return None
    fig, axes = _figure(2)
    for ax, series, title in zip(
        axes, (aggregate, per_request), ("aggregate output tok/s", "per-request tok/s (median 1000 / TPOT)")
    ):
        _lines(ax, series, arms)
        _concurrency_axis(ax, levels)
        ax.set_ylabel("tok/s", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
    return _finish(fig, axes)


def _percentiles(ax, by_pct: dict[str, Series], arms: Sequence[str]) -> None:
    """p50 / p90 / p99 lines of each arm on a log axis (the arm's name and the repetitions' band on its p50 line
    only: three bands an arm hide each other)."""
    for pct, style in PERCENTILE_STYLES:
        _lines(ax, by_pct.get(pct, {}), arms, style, label=pct == "p50", band=pct == "p50")
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.set_ylabel("ms (log scale)", fontsize=9)


def latency(ttft: dict[str, Series], tpot: dict[str, Series]) -> str | None:
    """TTFT and TPOT percentiles against concurrency: {percentile: {arm: [(C, [ms])]}} for each."""
    arms = list(dict.fromkeys(a for d in (ttft, tpot) for s in d.values() for a in s))
    levels = sorted({c for d in (ttft, tpot) for s in d.values() for pts in s.values() for c, _ in pts})
    if not levels:
        return None
    fig, axes = _figure(2)
    for ax, by_pct, title in ((axes[0], ttft, "TTFT"), (axes[1], tpot, "TPOT")):
        _percentiles(ax, by_pct, arms)
        _concurrency_axis(ax, levels)
        ax.set_title(f"{title} p50, p90, p99", fontsize=10)
    return _finish(fig, axes, styles=True)


def cdf(samples: dict[str, dict[str, list[float]]]) -> str | None:
    """{arm: {"TTFT ms": [...], "TPOT ms": [...]}}: each metric's empirical CDF, one curve an arm."""
    metrics = list(dict.fromkeys(m for d in samples.values() for m, v in d.items() if v))
    if not metrics:
        return None
    fig, axes = _figure(2)
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    for ax, name in zip(axes, metrics):
        for (arm, by_metric), color in zip(samples.items(), itertools.cycle(COLORS)):
            values = sorted(v for v in by_metric.get(name, []) if v is not None and v > 0)
            if values:
                ax.step(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    where="post",
                    color=color,
                    linewidth=1.4,
                    label=arm,
                )
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
        ax.set_xlabel(f"{name} (log scale)", fontsize=9)
        ax.set_ylabel("share of requests", fontsize=9)
        ax.set_ylim(0, 1.02)
        counts = ", ".join(
            f"{arm} {sum(v is not None and v > 0 for v in d.get(name, []))}" for arm, d in samples.items()
        )
        ax.set_title(f"{name.split()[0]} distribution (requests: {counts})", fontsize=10)
    return _finish(fig, axes[: len(metrics)])


def rates(output: Series, ttft: dict[str, Series]) -> str | None:
    """Output tok/s and TTFT p50 / p90 / p99 against the offered requests/s: where throughput flattens while
    latency climbs, the server saturated."""
    arms = list(dict.fromkeys([*output, *(a for s in ttft.values() for a in s)]))
    levels = sorted({r for pts in output.values() for r, _ in pts})
    if not levels:
        return None
    fig, (left, right) = _figure(2)
    _lines(left, output, arms)
    left.set_ylabel("tok/s", fontsize=9)
    left.set_title("output tok/s against the offered rate", fontsize=10)
    left.set_ylim(bottom=0)
    _percentiles(right, ttft, arms)
    right.set_title("TTFT p50, p90, p99", fontsize=10)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{r:g}" for r in levels])
        ax.minorticks_off()
        ax.set_xlabel("offered requests/s", fontsize=9)
    return _finish(fig, (left, right), styles=True)
