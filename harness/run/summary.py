"""The summary a person reads at the end of a run: per model, a table of one row an arm, the verdict lines
against mlx-lm (`headline`), and numbered notes for what a cell cannot say.

    decode tok/s   median over the decode phase's requests (1000 / TPOT); "too short" when the decode
                   phase is too short to time (`measured.too_short`), and then no ratio or roofline either
    TTFT cold/warm median TTFT of the cold and warm phases, ms
    agg@C          output tokens per second with C requests at once (the geometric mean over the cell's
                   repetitions, `repetitions`)
    peak RSS       of the server's whole process tree
    roofline       decode rate / (memory bandwidth / weight bytes), where the bandwidth is known
    probe          the greedy parity probe against the first arm
    kernels        the kernel tier an engine arm's server reported (/stats); - for other servers

Below each table, a line an arm against mlx-lm (`headline.verdict_lines`: decode, cold TTFT, the largest
concurrency's aggregate, every faster or slower verdict), withheld ratios and too-short cells as numbered
notes, so that the table keeps narrow columns (it fits 100 columns on a CPU run). `markdown` escapes every cell
(`md_cell`): labels, model and arm names come from the command line and must not break the table or inject
HTML.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import UnknownModelError
from engine.registry import get_spec  # the light registry, no MLX
from harness.run import cells, headline
from harness.run.anomalies import flagged_lines
from harness.run.arrivals import is_burst, saturated
from harness.run.measured import decode_rate, geomean, metric
from harness.run.records import MEASURED, RECOVERED
from harness.run.repetitions import is_repetition, repetitions

FAST_TIER = "fast"  # engine.kernels.FAST, named here so the summary stays free of the engine's imports

# Peak memory bandwidth of machines we know, bytes/s (the decode roofline's numerator).
KNOWN_BANDWIDTH = {"NVIDIA H200": 4.8e12}


def _itl_spread(m: dict) -> str:
    """' (N.Nx p50)' after an ITL p99: how much longer the rare token gap is than the usual one ('' without both)."""
    p50, p99 = m.get("median_itl_ms"), m.get("p99_itl_ms")
    return f" ({p99 / p50:.1f}x p50)" if p50 and p99 is not None else ""


def weight_bytes(model_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def rows(run: dict) -> list[dict]:
    """One row an arm of each model record (a trials file: of each block; a run: block 0, a load cell's value the
    geometric mean over its repetitions)."""

    gpu = run["provenance"].get("gpu", "")
    bandwidth = next((bw for name, bw in KNOWN_BANDWIDTH.items() if name in gpu), None)
    out = []
    for m in run["models"]:
        if is_repetition(run, m):
            continue
        again = repetitions(run, m)
        probe_ref = next((a for a in m["arms"] if a["arm"] == m["parity"].get("reference")), None)
        roof = bandwidth / weight_bytes(m["model_dir"]) if bandwidth and Path(m["model_dir"]).exists() else None
        for arm in m["arms"]:
            decode, short = decode_rate(arm)
            same = [arm] + [a for r in again for a in r["arms"] if a["arm"] == arm["arm"]]
            out.append(
                {
                    "block": m["block"],
                    "model": m["model"],
                    "arm": arm["arm"],
                    "status": arm["status"],
                    "decode_tps": decode,
                    "decode_note": short,
                    "ttft_cold_ms": metric(arm, "cold", "median_ttft_ms"),
                    "ttft_warm_ms": metric(arm, "warm", "median_ttft_ms"),
                    "aggregate_tps": {
                        p.split("-", 1)[1]: geomean([metric(a, p, "output_throughput") for a in same])
                        for p in (c["phase"] for c in arm["cells"])
                        if p.startswith("concurrency-")
                    },
                    "peak_rss_bytes": arm["peak_rss_bytes"],
                    "load_to_ready_s": arm["load_to_ready_s"],
                    "parity": (m["parity"].get("verdicts", {}).get(arm["arm"]) or {}).get("match"),
                    "roofline": round(decode / roof, 4) if decode and roof else None,
                    "kernels": (arm.get("kernels") or {}).get("tier"),
                    # token identity is the expectation between exact-tier arms only: the fast tier rounds otherwise
                    "probe_rounds": FAST_TIER
                    in ((arm.get("kernels") or {}).get("tier"), ((probe_ref or {}).get("kernels") or {}).get("tier")),
                }
            )
    return out


def fmt(x, spec: str = ".1f") -> str:
    """A number for a table cell; - when it is missing."""
    return "-" if x is None else format(x, spec)


class Notes:
    """Numbered notes under a table: `mark(text)` gives text's '[n]' (the same number for the same text)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self.texts, 1)]


FAST_TIER_PROBE = (
    "the probe's output differs from its reference arm's: the fast tier rounds otherwise (token "
    "identity is expected between exact-tier arms only)"
)


def table_cells(
    r: dict, concurrency: list[str], notes: Notes, blocks: bool = False, roofline: bool = False
) -> list[str]:
    """A row's cells (`headers`); what a cell cannot say in a few characters goes to `notes`."""
    parity = {
        True: "same",
        False: f"differs {notes.mark(FAST_TIER_PROBE)}" if r.get("probe_rounds") else "DIFFERS",
        None: "-",
    }[r["parity"]]
    arm = r["arm"] + ("" if r["status"] == MEASURED else f" ({r['status']})")
    decode = (
        f"too short {notes.mark(r['arm'] + ': ' + r['decode_note'])}" if r.get("decode_note") else fmt(r["decode_tps"])
    )
    agg = "/".join(
        fmt(x, ".0f" if x is not None and x >= 100 else ".1f") for x in (r["aggregate_tps"].get(c) for c in concurrency)
    )
    return [
        *([str(r["block"])] if blocks else []),
        arm,
        decode,
        fmt(r["ttft_cold_ms"], ".0f"),
        fmt(r["ttft_warm_ms"], ".0f"),
        *([agg] if concurrency else []),
        fmt(r["peak_rss_bytes"] / 2**20 if r["peak_rss_bytes"] else None, ".0f"),
        *([fmt(r["roofline"], ".1%")] if roofline else []),
        parity,
        r.get("kernels") or "-",
    ]


def headers(concurrency: list[str], blocks: bool = False, roofline: bool = False) -> list[str]:
    """The table's columns: aggregate tok/s at every concurrency in one ('agg@4/8 tok/s': '28.4/32.3')."""
    return [
        *(["block"] if blocks else []),
        "arm",
        "decode tok/s",
        "TTFT cold ms",
        "TTFT warm ms",
        *([f"agg@{'/'.join(concurrency)} tok/s"] if concurrency else []),
        "peak RSS MiB",
        *(["roofline"] if roofline else []),
        "probe",
        "kernels",
    ]


def concurrency_levels(rs: list[dict]) -> list[str]:
    return sorted({c for r in rs for c in r["aggregate_tps"]}, key=int)


@dataclass
class ModelSummary:
    """One model's part of the summary: its table, its verdict lines, and the notes both refer to."""

    model: str
    headers: list[str]
    rows: list[list[str]]
    against: str = ""  # what the lines compare with
    lines: list[str] = field(default_factory=list)  # a verdict line an arm, then what was withheld
    notes: list[str] = field(default_factory=list)


BASELINE = "mlx-lm"


def model_summaries(run: dict) -> list[ModelSummary]:
    """Per model (a trials file: its blocks in one table), its table, verdict lines and notes."""

    rs, blocks = rows(run), run["kind"] == "trials"
    out = []
    for name in dict.fromkeys(r["model"] for r in rs):
        mine, notes = [r for r in rs if r["model"] == name], Notes()
        conc, roofline = concurrency_levels(mine), any(r["roofline"] is not None for r in mine)
        summary = ModelSummary(
            name, headers(conc, blocks, roofline), [table_cells(r, conc, notes, blocks, roofline) for r in mine]
        )
        if blocks:
            summary.against = f"paired verdicts over the blocks against {BASELINE}: harness report on this file"
        for m in (m for m in run["models"] if m["model"] == name and not blocks and not is_repetition(run, m)):
            base = next((a for a in m["arms"] if a["arm"] == BASELINE), None)
            compared = headline.model_rows(run, m, run, base)
            if compared:
                summary.against = f"against {BASELINE} (Nx: times as fast, [95% interval], verdict):"
            for line in headline.verdict_lines(compared):
                summary.lines.append(headline.line_text(line, lambda why: f"withheld {notes.mark(why)}"))
            if withheld := headline.withheld_count(compared):
                summary.lines.append(withheld)
        summary.notes = notes.lines()
        out.append(summary)
    return out


def md_text(x) -> str:
    """Any string as Markdown inline text: HTML-special characters as entities, line breaks as spaces."""
    return html.escape(" ".join(str(x).splitlines()), quote=True)


def md_cell(x) -> str:
    """Any string as one Markdown table cell: `md_text`, with pipes escaped (a pipe would end the cell)."""
    return md_text(x).replace("\\", "\\\\").replace("|", "\\|")


def md_row(cells: list) -> str:
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"


def markdown(run: dict) -> str:
    title = f"# Run {md_text(run['run_id'])} ({md_text(run['created'])})"
    if run.get("label"):
        title += f": {md_text(run['label'])}"
    if run["diagnostic"]:
        title += " — DIAGNOSTIC (machine was busy)"
    lines = [title, ""]
    if run.get("status") not in (None, "finished"):
        lines += [f"**{md_text(run['status'])}**" + (f": {md_text(run['error'])}" if run.get("error") else ""), ""]
    for ms in model_summaries(run):
        lines += [f"## {md_text(ms.model)}", "", md_row(ms.headers), "|" + "---|" * len(ms.headers)]
        lines += [md_row(r) for r in ms.rows] + [""] + ([md_text(ms.against), ""] if ms.against else [])
        lines += [f"- {md_text(line)}" for line in ms.lines + ms.notes] + [""] * bool(ms.lines or ms.notes)
    latency = latency_rows(run)
    if latency:
        lines += [
            "Latency percentiles per timed cell:",
            "",
            md_row(LATENCY_HEADERS),
            "|" + "---|" * len(LATENCY_HEADERS),
        ]
        lines += [md_row(r) for r in latency]
    load = load_lines(run)
    if load:
        lines += ["", "Load:", ""] + [f"- {md_text(line)}" for line in load]
    goodput = goodput_lines(run)
    if goodput:
        lines += ["", md_text(goodput[0]), ""] + [f"- {md_text(line)}" for line in goodput[1:]]
    quality = quality_lines(run)
    if quality:
        lines += ["", "Held-out perplexity (`harness quality`'s text, after each server stopped):", ""]
        lines += [f"- {md_text(q)}" for q in quality]

    flagged = flagged_lines(run)
    if flagged:
        lines += ["", "Flagged cells (docs/benchmark.md states the rules):", ""] + [f"- {md_text(f)}" for f in flagged]
    compiled = compiled_cells(run)
    if compiled:
        lines += [
            "",
            "Cells during which an engine server first ran forward shapes or compiled kernel modules "
            "(on CUDA: compilations while requests waited):",
            "",
        ] + [f"- {md_text(c)}" for c in compiled]
    return "\n".join(lines) + "\n"


LATENCY_HEADERS = [
    "model",
    "arm",
    "phase",
    "requests",
    "TTFT p50 / p90 / p99 ms",
    "TPOT p50 / p90 / p99 ms",
    "ITL p50 / p99 ms",
    "E2EL p50 / p99 ms",
    "goodput req/s",
    "SLO attainment",
]


def latency_rows(run: dict) -> list[list[str]]:
    """Per timed cell (decode, TTFT phases, each concurrency, long context): its requests' latency percentiles
    (the JSON's {median,p90,p99}_{ttft,tpot,itl,e2el}_ms) and, with SLOs, goodput and attainment. Where a model
    has several blocks (trials, repeated cells) a phase is named with its block's number ('concurrency-4 #2')."""

    def pcts(m: dict, name: str, which=("median", "p90", "p99")) -> str:
        values = [m.get(f"{w}_{name}_ms") for w in which]
        return (
            "-"
            if all(v is None for v in values)
            else " / ".join(fmt(v, ".0f" if (v or 0) >= 100 else ".1f") for v in values)
        )

    slos = bool(run["settings"].get("goodput"))
    models = run.get("models", [])
    out = []
    for mrun in models:
        several = sum(m["model"] == mrun["model"] for m in models) > 1
        for arm in mrun.get("arms", []):
            for cell in arm.get("cells", []):
                m = cell.get("metrics") or {}
                if not cells.timed(cell["phase"]) or cell["status"] not in (MEASURED, RECOVERED):
                    continue
                phase = cell["phase"] + (f" #{mrun.get('block', 0) + 1}" if several else "")
                out.append(
                    [
                        mrun["model"],
                        arm["arm"],
                        phase,
                        str(m.get("completed", "-")),
                        pcts(m, "ttft"),
                        pcts(m, "tpot"),
                        pcts(m, "itl", ("median", "p99")),
                        pcts(m, "e2el", ("median", "p99")),
                        fmt(m.get("request_goodput"), ".3g") if slos else "-",
                        f"{m['slo_attainment']:.0%}" if slos and m.get("slo_attainment") is not None else "-",
                    ]
                )
    return out


def load_lines(run: dict) -> list[str]:
    """Per arm with rate cells: each offered rate's achieved requests/s, output tok/s and TTFT, the saturation
    point (`arrivals.saturated`: the first rate at which the arm was saturated) and, with SLOs, the highest rate
    whose attainment stayed at `slo_target`; per arm with a shared-prefix cell: its groups' first TTFT against the
    rest's, and the cached tokens; each cell's prefill rate; the chat probe's verdicts. A sweep that ended on a burst
    (`arrivals.is_burst`) says so."""

    target = run["settings"].get("slo_target", 0.9)
    slos = bool(run["settings"].get("goodput"))
    out = []
    for mrun in run.get("models", []):
        chat = (mrun.get("parity") or {}).get("chat") or {}
        if chat.get("verdicts"):
            out.append(
                f"{mrun['model']} / chat probe (first chat reply and prompt tokens against {chat['reference']}): "
                + "; ".join(
                    f"{arm}: {v['compared']}"
                    if v["match"] is None
                    else f"{arm}: {'same' if v['match'] else 'DIFFERS'} ({v.get('prompt_tokens')} prompt tokens)"
                    for arm, v in chat["verdicts"].items()
                )
            )
        for arm in mrun.get("arms", []):
            name = f"{mrun['model']} / {arm['arm']}"
            cells = [
                c
                for c in arm.get("cells", [])
                if c["phase"].startswith("rate-") and c["status"] in (MEASURED, RECOVERED)
            ]
            if cells:
                steps = ", ".join(
                    f"{c['metrics']['offered_rate']:g} -> {fmt(c['metrics'].get('request_throughput'), '.2f')} req/s "
                    f"{fmt(c['metrics'].get('output_throughput'), '.1f')} tok/s TTFT {fmt(c['metrics'].get('median_ttft_ms'), '.0f')} ms"
                    for c in cells
                )
                knee = next(
                    (
                        c
                        for i, c in enumerate(cells, 1)
                        if saturated(
                            [x["metrics"].get("output_throughput") for x in cells[:i]],
                            [x["metrics"].get("median_ttft_ms") for x in cells[:i]],
                        )
                    ),
                    None,
                )
                bursts = [
                    c
                    for c in cells
                    if is_burst(
                        [r["sent_at"] for a in c["attempts"] if a["ok"] for r in a["requests"]],
                        c["metrics"].get("median_e2el_ms"),
                    )
                ]
                line = f"{name}: offered -> achieved: {steps}; " + (
                    f"saturated at {knee['metrics']['offered_rate']:g} req/s (throughput no higher than at the rate "
                    "before while TTFT climbed)"
                    if knee
                    else "not saturated at the rates measured"
                )
                if bursts and not knee:
                    b = bursts[0]["metrics"]
                    sent = sum(len(a["requests"]) for a in bursts[0]["attempts"] if a["ok"])
                    line += (
                        f" (from {b['offered_rate']:g} req/s on, a cell's {sent} requests arrived within their "
                        f"median E2EL of {b['median_e2el_ms'] / 1e3:.1f} s: a burst, not a sustained rate; more "
                        "--rate-requests load higher rates)"
                    )
                if slos:
                    held = [
                        c["metrics"]["offered_rate"]
                        for c in cells
                        if (c["metrics"].get("slo_attainment") or 0) >= target
                    ]
                    line += (
                        f"; highest rate with SLO attainment >= {target:.0%}: {max(held):g} req/s"
                        if held
                        else f"; no rate kept SLO attainment >= {target:.0%}"
                    )
                out.append(line)
            chat = next(
                (c for c in arm.get("cells", []) if c["phase"] == "multiturn" and c["status"] in (MEASURED, RECOVERED)),
                None,
            )
            if chat:
                m = chat["metrics"]
                turns = "; ".join(
                    f"turn {t + 1}: {ms:.0f} ms, {cached} of {prompt} prompt tokens cached"
                    for t, (ms, cached, prompt) in enumerate(
                        zip(m["turn_ttft_ms"], m["turn_cached_tokens"], m["turn_prompt_tokens"])
                    )
                )
                out.append(f"{name} / multiturn (median TTFT over the chats): {turns}")
            for c in arm.get("cells", []):
                m = c.get("metrics") or {}
                if c["status"] in (MEASURED, RECOVERED) and m.get("median_prefill_tps") is not None:
                    out.append(
                        f"{name} / {c['phase']}: prefill {m['median_prefill_tps']:,.0f} prompt tok/s (median over "
                        f"{m['completed']}), TTFT p50 {fmt(m.get('median_ttft_ms'), '.0f')} ms p99 "
                        f"{fmt(m.get('p99_ttft_ms'), '.0f')} ms, TPOT p50 {fmt(m.get('median_tpot_ms'), '.1f')} ms"
                        + (  # rows decoding beside a prefill: how far the prefill stretched their token gaps
                            f", ITL p50 {fmt(m.get('median_itl_ms'), '.1f')} ms "
                            f"p99 {fmt(m.get('p99_itl_ms'), '.1f')} ms{_itl_spread(m)}"
                            if c["phase"] == "staggered"
                            else ""
                        )
                    )
            prefix = next(
                (c for c in arm.get("cells", []) if c["phase"] == "prefix" and c["status"] in (MEASURED, RECOVERED)),
                None,
            )
            if prefix:
                m = prefix["metrics"]
                out.append(
                    f"{name} / prefix: a group's first request TTFT {fmt(m.get('median_first_ttft_ms'), '.0f')} ms, "
                    f"the others {fmt(m.get('median_shared_ttft_ms'), '.0f')} ms, cached tokens "
                    f"{sum(x or 0 for x in m.get('cached_tokens') or [])}"
                )
    return out


def goodput_lines(run: dict) -> list[str]:
    """With SLOs (`--goodput`): a heading line naming them, then 'model / arm / phase: goodput G req/s,
    attainment A%' for each measured timed cell; nothing without SLOs."""
    slos = run["settings"].get("goodput") or []
    if not slos:
        return []
    out = ["Goodput (requests meeting every SLO: " + ", ".join(f"{k} <= {ms:g} ms" for k, ms in slos) + "):"]
    for m in run.get("models", []):
        for arm in m.get("arms", []):
            for cell in arm.get("cells", []):
                mt = cell.get("metrics") or {}
                if cells.timed(cell["phase"]) and mt.get("slo_attainment") is not None:
                    out.append(
                        f"{m['model']} / {arm['arm']} / {cell['phase']}: goodput {mt['request_goodput']:g} "
                        f"req/s, attainment {mt['slo_attainment']:.0%} of {mt['requests']}"
                    )
    return out


def quality_lines(run: dict) -> list[str]:
    """'model / arm: held-out perplexity P over N tokens (tier T)' for each engine arm that measured it, with
    `perplexity_note` where it applies."""
    out = []
    for m in run.get("models", []):
        for arm in m.get("arms", []):
            q = arm.get("quality")
            if q and "perplexity" in q:
                note = perplexity_note(q, m["model"])
                out.append(
                    f"{m['model']} / {arm['arm']}: held-out perplexity {q['perplexity']:g} over {q['tokens']} "
                    f"tokens ({q['tier']} tier)" + (f"; {note}" if note else "")
                )
            elif q:
                out.append(f"{m['model']} / {arm['arm']}: held-out perplexity not measured ({q.get('error')})")
    return out


def perplexity_note(quality: dict, model: str) -> str:
    """Why a held-out perplexity says nothing of a model, or '': above the vocabulary's size a model predicts worse
    than a uniform guess would, as random (synthetic) weights do. The vocabulary: the record's (`vocab_size`), else
    the registry's for a registry name."""
    vocab = quality.get("vocab_size")
    if vocab is None:
        try:
            vocab = get_spec(model).geometry.vocab_size
        except UnknownModelError:
            return ""
    if not (quality.get("perplexity") or 0) > vocab:
        return ""
    return (
        f"worse than a uniform guess over the {vocab:,}-token vocabulary (perplexity {vocab:,}): random weights, "
        "so it checks the measurement, not a model"
    )


def compiled_cells(run: dict) -> list[str]:
    """'model / arm / phase: N new shapes, M kernel modules compiled' for each measured cell after the warm-up
    that ran new shapes or compiled modules."""
    out = []
    for m in run.get("models", []):
        for arm in m.get("arms", []):
            for cell in arm.get("cells", []):
                metrics = cell.get("metrics") or {}
                parts = [f"{metrics['new_shapes']} new shapes"] if metrics.get("new_shapes") else []
                if metrics.get("compiled_modules"):
                    parts.append(f"{metrics['compiled_modules']} kernel modules compiled")
                if parts and cell["phase"] != "warmup":
                    out.append(f"{m['model']} / {arm['arm']} / {cell['phase']}: {', '.join(parts)}")
    return out
