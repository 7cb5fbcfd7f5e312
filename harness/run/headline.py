"""Each arm against the baseline arm, per model: the compared rows, and the lines that say their verdicts.

`harness report`'s first screen and the summary at the end of `harness run all` read the same rows
(`comparable.compare` for each RATIO_METRICS entry a cell has, then memory) and say them the same way,
one line an arm:

    engine: decode 1.05x [1.04, 1.10] unknown; cold TTFT 2.43x unknown (1 request a side); agg@8 1.01x unknown
        (one burst)

Nx is how many times as fast as the baseline the arm was: the ratio for a rate, its inverse for a time (the
baseline's TTFT over the arm's), the interval turned likewise. A line names decode, cold TTFT and the largest
concurrency's aggregate, then every other ratio with a verdict of faster or slower, and counts the rest; what was
withheld is counted by reason in one line a model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from harness.run import cells, comparable
from harness.run.cells import RatioMetric
from harness.run.repetitions import is_load_phase, repeat_pairs
from harness.run.stats import ONE_BURST

NOT_ON_BOTH = "not measured on both"


# Every kind of cell's rows, in the order of `cells.KINDS`.
RATIO_METRICS = [m for kind in cells.KINDS for m in kind.ratio_metrics()]
GOODPUT = RatioMetric("", "request_goodput", "goodput req/s", "goodput", True, "req/s")
KEY_METRICS = ("decode", "cold TTFT")  # named on every verdict line, with the largest concurrency's aggregate


def level(phase: str) -> str:
    """' @8' for concurrency-8, ' @2 req/s' for rate-2, '' for other phases."""
    kind, _, level = phase.partition("-")
    return "" if not is_load_phase(phase) else f" @{level}" + (" req/s" if kind == "rate" else "")


def model_rows(run: dict, model: dict, base_run: dict | None, base: dict | None) -> list[dict]:
    """Every arm of `model` (a model record of `run`) against `base` (the baseline's arm record, of `base_run`):
    each RATIO_METRICS entry its cells have (goodput too where the run set SLOs), then peak RSS and device memory
    (one reading each: a ratio, no interval). A load cell's repetitions count where the baseline is in `run`."""
    if base is None:
        return []
    slos = bool(run["settings"].get("goodput"))
    rows = []
    for arm in model["arms"]:
        if arm is base:
            continue
        repeats = repeat_pairs(run, model, arm["arm"], base["arm"]) if base_run is run else []
        for phase in [c["phase"] for c in arm["cells"]]:
            metrics = [m for m in RATIO_METRICS if m.matches(phase)]
            metrics += [GOODPUT] if slos and is_load_phase(phase) else []
            for m in metrics:
                row = comparable.compare(
                    run,
                    arm,
                    base_run,
                    base,
                    phase,
                    m.label + level(phase),
                    m.key,
                    m.higher_is_better,
                    repeats if is_load_phase(phase) else (),
                )
                if row["value"] is None and row["baseline"] is None and row["withheld"] != NOT_ON_BOTH:
                    continue  # a metric neither arm's records hold (an older run's)
                rows.append(row | {"short": m.short + level(phase).replace(" @", "@"), "unit": m.unit})
        rows += _memory_rows(arm, base)
    return rows


def _memory_rows(arm: dict, base: dict) -> list[dict]:
    rows = []
    for label, value in (
        ("peak RSS", lambda a: (a.get("peak_rss_bytes") or 0) / 2**20 or None),
        ("device peak", lambda a: ((a.get("device_memory") or {}).get("peak_bytes") or 0) / 2**20 or None),
    ):
        a, b = value(arm), value(base)
        if a is None or (b is None and label.startswith("device")):  # mlx_lm.server reports no device memory
            continue
        rows.append(
            {
                "arm": arm["arm"],
                "baseline_arm": base["arm"],
                "phase": "-",
                "metric": label,
                "short": label,
                "unit": "MiB",
                "value": a,
                "baseline": b,
                "higher_is_better": False,
                "ratio": a / b if a and b else None,
                "ci_low": None,
                "ci_high": None,
                "verdict": None,
                "samples": 0,
                "note": "one reading" if a and b else "",
                "withheld": None if a and b else "no value on one side",
                "outputs": "",
            }
        )
    return rows


# ------------------------------------------------------------------ words


def value_text(x: float | None, unit: str) -> str:
    """A measured value with its unit, to the digits its size needs: 10,441 ms, 20.8 tok/s, 302 MiB, 0.48 req/s."""
    if x is None:
        return "-"
    if unit in ("ms", "MiB") or abs(x) >= 1000:
        return f"{x:,.0f} {unit}"
    return f"{x:,.{1 if abs(x) >= 10 else 2}f} {unit}"


def number(x: float) -> str:
    return f"{x:.1f}" if x >= 9.995 else f"{x:.2f}"


def interval_text(lo: float | None, hi: float | None) -> str:
    """'[lo, hi]' with the digits that tell the two ends apart (2 to 4 decimals); '' without an interval."""
    if lo is None or hi is None:
        return ""
    digits = next((d for d in (2, 3, 4) if f"{lo:.{d}f}" != f"{hi:.{d}f}"), 4)
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def speed(row: dict) -> tuple[float | None, float | None, float | None]:
    """(factor, low, high): how many times as fast as the baseline, for a rate the ratio, for a time its inverse."""
    if row["ratio"] is None:
        return None, None, None
    if row["higher_is_better"]:
        return row["ratio"], row["ci_low"], row["ci_high"]
    flip = lambda x: None if x is None else 1 / x  # noqa: E731
    return flip(row["ratio"]), flip(row["ci_high"]), flip(row["ci_low"])


# the words of an unknown verdict's note worth a verdict line (not 'about N more would settle it')
SHORT_NOTES = {
    ONE_BURST: ONE_BURST,
    "zero-width": "zero-width interval",
    "to one side": "resamples to one side",
    "too few blocks": "too few blocks",
}


def why_unknown(note: str) -> str:
    if "a side: no interval" in note:
        return note.split(":")[0]  # '1 request a side'
    return next((short for words, short in SHORT_NOTES.items() if words in note), "")


def part_text(row: dict) -> str:
    """One row on a verdict line: 'decode 1.05x [1.04, 1.10] unknown'."""
    factor, lo, hi = speed(row)
    text = f"{row['short']} {number(factor)}x"
    interval = interval_text(lo, hi)
    text += f" {interval}" if interval else ""
    verdict = row["verdict"] or "one reading"
    why = why_unknown(row["note"] or "") if verdict == "unknown" else ""
    return f"{text} {verdict}" + (f" ({why})" if why else "")


def withheld_kind(row: dict) -> str:
    """A withheld row's reason without its arm and its particulars ('too short', 'diagnostic run')."""
    why = row["withheld"]
    for arm in (row["arm"], row["baseline_arm"]):
        why = why.removeprefix(f"{arm}: ")
    return why.split(":")[0].split(" (")[0]


@dataclass(frozen=True)
class Part:
    """One named row of a verdict line: 'decode 1.05x [1.04, 1.10] unknown', or a key metric withheld (`withheld`:
    the reason, `text` its short name)."""

    text: str
    verdict: str
    withheld: str = ""


@dataclass(frozen=True)
class VerdictLine:
    arm: str
    parts: list[Part]  # in the rows' order
    rest: str  # '4 more: 3 same, 1 unknown'


def verdict_lines(rows: list[dict]) -> list[VerdictLine]:
    """Per arm, in the rows' order: its key metrics and every faster or slower verdict (the module docstring)."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm and r["phase"] != "-"]
        levels = [r for r in mine if r["phase"].startswith("concurrency-")]
        top = max(levels, key=lambda r: int(r["phase"].split("-")[1]))["phase"] if levels else None

        def named(r: dict) -> bool:
            return r["short"] in KEY_METRICS or (r["phase"] == top and r["short"].startswith("agg"))

        parts, rest = [], Counter()
        for r in mine:
            if r["withheld"]:
                if named(r) and r["withheld"] != NOT_ON_BOTH:
                    parts.append(Part(r["short"], "withheld", r["withheld"]))
            elif r["ratio"] is not None and (named(r) or r["verdict"] in ("faster", "slower")):
                parts.append(Part(part_text(r), r["verdict"] or ""))
            elif r["ratio"] is not None:
                rest[r["verdict"] or "one reading"] += 1
        more = f"{sum(rest.values())} more: " + ", ".join(f"{n} {v}" for v, n in rest.most_common()) if rest else ""
        if parts or more:
            out.append(VerdictLine(arm, parts, more))
    return out


def withheld_count(rows: list[dict]) -> str:
    """'withheld: 14 ratios (not measured on both 12, no value on one side 2)'; '' when none was."""
    kinds = Counter(withheld_kind(r) for r in rows if r["withheld"])
    if not kinds:
        return ""
    n = sum(kinds.values())
    return f"withheld: {n} ratio{'s' * (n != 1)} (" + ", ".join(f"{k} {c}" for k, c in kinds.most_common()) + ")"


def line_text(line: VerdictLine, withheld=lambda why: f"withheld: {why}") -> str:
    """A verdict line as plain text; `withheld` words a withheld key metric's reason (the terminal numbers it)."""
    parts = [f"{p.text} {withheld(p.withheld)}" if p.withheld else p.text for p in line.parts]
    return f"{line.arm}: " + "; ".join(parts + ([line.rest] if line.rest else []))
