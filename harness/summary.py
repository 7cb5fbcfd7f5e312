"""The table a person reads at the end of a run: per model, one row per arm.

    decode tok/s   median over the decode phase's requests (1000 / TPOT); "too short" when the decode
                   phase is too short to time (`too_short`), and then no ratio or roofline either
    TTFT cold/warm median TTFT of the cold and warm phases, ms
    agg@C          output tokens per second with C requests at once
    peak RSS       of the server's whole process tree
    x mlx-lm       decode rate / the mlx-lm arm's, its interval and verdict from the paired requests
                   (`comparable.compare`; withheld with the reason on a busy machine or other work)
    roofline       decode rate / (memory bandwidth / weight bytes), where the bandwidth is known
    kernels        the kernel tier an engine arm's server reported (/stats); - for other servers

`markdown` escapes every cell (`md_cell`): labels, model and arm names come
from the command line and must not break the table or inject HTML.
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Optional

from harness.records import MEASURED, RECOVERED

FAST_TIER = "fast"  # engine.kernels.FAST, named here so the summary stays free of the engine's imports

# A decode rate is timed over the tokens after the first, E2EL - TTFT. With few of them, or a few
# milliseconds, it measures how the server flushes its stream (mlx_lm.server can send a short output
# in one burst: 7 tokens "at" 18,814 tok/s) and the clock, not decoding.
MIN_TIMED_TOKENS = 16
MIN_DECODE_MS = 50.0

# Peak memory bandwidth of machines we know, bytes/s (the decode roofline's numerator).
KNOWN_BANDWIDTH = {"NVIDIA H200": 4.8e12}


def cell_of(arm: dict, phase: str) -> Optional[dict]:
    for c in arm["cells"]:
        if c["phase"] == phase and c["status"] in (MEASURED, RECOVERED):
            return c
    return None


def metric(arm: dict, phase: str, key: str) -> Optional[float]:
    c = cell_of(arm, phase)
    return None if c is None else c["metrics"].get(key)


def ok_requests(cell: dict) -> list[dict]:
    return [r for att in cell["attempts"] if att["ok"] for r in att["requests"]]


def too_short(cell: dict) -> Optional[str]:
    """Why a decode cell is too short to time, or None. The rule, on the cell's median request: fewer than
    MIN_TIMED_TOKENS tokens after the first, or under MIN_DECODE_MS between the first and the last."""
    spans = [(r["output_tokens"] - 1, r["e2el_ms"] - r["ttft_ms"]) for r in ok_requests(cell)
             if r.get("output_tokens") and r.get("e2el_ms") is not None and r.get("ttft_ms") is not None]  # fmt: skip
    if not spans:
        return "too short: no timed tokens"
    tokens, ms = statistics.median(t for t, _ in spans), statistics.median(m for _, m in spans)
    if tokens < MIN_TIMED_TOKENS:
        return f"too short: {tokens:g} timed tokens (< {MIN_TIMED_TOKENS})"
    if ms < MIN_DECODE_MS:
        return f"too short: {ms:.1f} ms of decode (< {MIN_DECODE_MS:g} ms)"
    return None


def decode_rate(arm: dict) -> tuple[Optional[float], Optional[str]]:
    """The arm's median decode rate, or None and why it is withheld (too short to time)."""
    cell = cell_of(arm, "decode")
    if cell is None:
        return None, None
    short = too_short(cell)
    return (None, short) if short else (cell["metrics"].get("median_decode_tps"), None)


def run_nonce(arm: dict) -> str:
    """The run nonce that opened the arm's prompts (`workloads.with_run_nonce`: a server the harness did not
    start); "" for the frozen workload."""
    return (arm.get("endpoint") or {}).get("run_nonce") or ""


def same_work(a: dict, b: dict, phase: str) -> Optional[str]:
    """None when both arms did the same work in `phase`: the same attempt (a retry sends other prompts), the
    same requests (prompt hashes where both records have them and one run nonce opened both arms' prompts, else
    prompt lengths), output counts, finish reasons and cached prompt tokens to within CACHED_SLACK of the
    prompts' (a server that reports none counts as 0); else why not."""
    ca, cb = cell_of(a, phase), cell_of(b, phase)
    if ca is None or cb is None:
        return "not measured on both"
    attempts = [[t["attempt"] for t in c["attempts"] if t["ok"]] for c in (ca, cb)]
    if attempts[0] != attempts[1]:
        return f"different attempts (measured on attempt {attempts[0][-1]} against {attempts[1][-1]})"
    ra, rb = ok_requests(ca), ok_requests(cb)
    hashes = [[r.get("prompt_sha256") for r in rs] for rs in (ra, rb)]
    if run_nonce(a) == run_nonce(b) and None not in hashes[0] + hashes[1] and hashes[0] != hashes[1]:
        return "different requests (prompt hashes)"
    if [r["prompt_tokens_sent"] for r in ra] != [r["prompt_tokens_sent"] for r in rb]:
        return "different prompts"
    if [r["output_tokens"] for r in ra] != [r["output_tokens"] for r in rb]:
        return "different output counts"
    if [r["finish_reason"] for r in ra] != [r["finish_reason"] for r in rb]:
        return "different finish reasons"
    cached = [sum(r.get("cached_tokens") or 0 for r in rs) for rs in (ra, rb)]
    if abs(cached[0] - cached[1]) > CACHED_SLACK * sum(r["prompt_tokens_sent"] for r in ra):
        return f"different cached tokens ({cached[0]} against {cached[1]})"
    return None


# Cached prompt tokens may differ by this share of the prompt tokens and still count as the same work: a few
# tokens a prompt shared with an earlier one change the prefill by as little.
CACHED_SLACK = 0.01


def weight_bytes(model_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def rows(run: dict) -> list[dict]:
    gpu = run["provenance"].get("gpu", "")
    bandwidth = next((bw for name, bw in KNOWN_BANDWIDTH.items() if name in gpu), None)
    out = []
    for m in run["models"]:
        base = next((a for a in m["arms"] if a["arm"] == "mlx-lm"), None)
        probe_ref = next((a for a in m["arms"] if a["arm"] == m["parity"].get("reference")), None)
        roof = bandwidth / weight_bytes(m["model_dir"]) if bandwidth and Path(m["model_dir"]).exists() else None
        for arm in m["arms"]:
            decode, short = decode_rate(arm)
            row = {
                "block": m["block"], "model": m["model"], "arm": arm["arm"], "status": arm["status"],
                "decode_tps": decode, "decode_note": short,
                "ttft_cold_ms": metric(arm, "cold", "median_ttft_ms"),
                "ttft_warm_ms": metric(arm, "warm", "median_ttft_ms"),
                "aggregate_tps": {p.split("-", 1)[1]: metric(arm, p, "output_throughput")
                                  for p in (c["phase"] for c in arm["cells"]) if p.startswith("concurrency-")},
                "peak_rss_bytes": arm["peak_rss_bytes"],
                "load_to_ready_s": arm["load_to_ready_s"],
                "parity": (m["parity"].get("verdicts", {}).get(arm["arm"]) or {}).get("match"),
                "vs_mlx_lm": None, "vs_mlx_lm_note": None,
                "roofline": round(decode / roof, 4) if decode and roof else None,
                "kernels": (arm.get("kernels") or {}).get("tier"),
                # token identity is the expectation between exact-tier arms only: the fast tier rounds otherwise
                "probe_rounds": FAST_TIER in ((arm.get("kernels") or {}).get("tier"),
                                              ((probe_ref or {}).get("kernels") or {}).get("tier")),
            }  # fmt: skip
            if base is not None and arm is not base:
                from harness.comparable import compare  # it reads this module's cells

                c = compare(run, arm, run, base, "decode", "decode tok/s", "median_decode_tps", True)
                if c["withheld"] is None and c["ratio"]:
                    row["vs_mlx_lm"] = round(c["ratio"], 4)
                    interval = f" [{c['ci_low']:.2f}, {c['ci_high']:.2f}]" if c["ci_low"] is not None else ""
                    row["vs_mlx_lm_note"] = f"{interval} {c['verdict']}".strip()
                else:
                    row["vs_mlx_lm_note"] = c["withheld"] or "no decode rate"
            out.append(row)
    return out


def fmt(x, spec: str = ".1f") -> str:
    """A number for a table cell; - when it is missing."""
    return "-" if x is None else format(x, spec)


def table_cells(r: dict, concurrency: list[str], blocks: bool = False) -> list[str]:
    parity = {True: "same", False: "differs (fast tier)" if r.get("probe_rounds") else "DIFFERS", None: "-"}[r["parity"]]
    if r["vs_mlx_lm"] is not None:
        ratio = f"{r['vs_mlx_lm']:.2f} {r['vs_mlx_lm_note'] or ''}".strip()
    else:
        ratio = f"withheld ({r['vs_mlx_lm_note']})" if r["vs_mlx_lm_note"] else "-"
    decode = "too short" if r.get("decode_note") else fmt(r["decode_tps"])
    return [*([str(r["block"])] if blocks else []), r["model"], r["arm"], r["status"], decode, fmt(r["ttft_cold_ms"], ".0f"),
            fmt(r["ttft_warm_ms"], ".0f"), *[fmt(r["aggregate_tps"].get(c)) for c in concurrency],
            fmt(r["peak_rss_bytes"] / 2**20 if r["peak_rss_bytes"] else None, ".0f"), ratio,
            fmt(r["roofline"], ".1%"), parity, r.get("kernels") or "-"]  # fmt: skip


def headers(concurrency: list[str], blocks: bool = False) -> list[str]:
    return [*(["block"] if blocks else []), "model", "arm", "status", "decode tok/s", "TTFT cold ms", "TTFT warm ms",
            *[f"agg@{c} tok/s" for c in concurrency], "peak RSS MiB", "decode x mlx-lm", "roofline", "probe",
            "kernels"]  # fmt: skip


def concurrency_levels(rs: list[dict]) -> list[str]:
    return sorted({c for r in rs for c in r["aggregate_tps"]}, key=int)


def md_text(x) -> str:
    """Any string as Markdown inline text: HTML-special characters as entities, line breaks as spaces."""
    return html.escape(" ".join(str(x).splitlines()), quote=True)


def md_cell(x) -> str:
    """Any string as one Markdown table cell: `md_text`, with pipes escaped (a pipe would end the cell)."""
    return md_text(x).replace("\\", "\\\\").replace("|", "\\|")


def md_row(cells: list) -> str:
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"


def markdown(run: dict) -> str:
    rs = rows(run)
    conc, blocks = concurrency_levels(rs), run["kind"] == "trials"
    head = headers(conc, blocks)
    title = f"# Run {md_text(run['run_id'])} ({md_text(run['created'])})"
    if run.get("label"):
        title += f": {md_text(run['label'])}"
    if run["diagnostic"]:
        title += " — DIAGNOSTIC (machine was busy)"
    lines = [title, ""]
    if run.get("status") not in (None, "finished"):
        lines += [f"**{md_text(run['status'])}**" + (f": {md_text(run['error'])}" if run.get("error") else ""), ""]
    lines += [md_row(head), "|" + "---|" * len(head)]
    lines += [md_row(table_cells(r, conc, blocks)) for r in rs]
    latency = latency_rows(run)
    if latency:
        lines += ["", "Latency percentiles per timed cell:", "", md_row(LATENCY_HEADERS), "|" + "---|" * len(LATENCY_HEADERS)]
        lines += [md_row(r) for r in latency]
    load = load_lines(run)
    if load:
        lines += ["", "Load:", ""] + [f"- {md_text(line)}" for line in load]
    goodput = goodput_lines(run)
    if goodput:
        lines += ["", md_text(goodput[0]), ""] + [f"- {md_text(line)}" for line in goodput[1:]]
    quality = quality_lines(run)
    if quality:
        lines += ["", "Held-out perplexity (`harness quality`'s text, in process):", ""]
        lines += [f"- {md_text(q)}" for q in quality]
    from harness.anomalies import flagged_lines  # it reads this module's cells

    flagged = flagged_lines(run)
    if flagged:
        lines += ["", "Flagged cells (docs/benchmark.md states the rules):", ""] + [f"- {md_text(f)}" for f in flagged]
    compiled = compiled_cells(run)
    if compiled:
        lines += ["", "Cells during which an engine server first ran forward shapes or compiled kernel modules "
                  "(on CUDA: compilations while requests waited):", ""] + [f"- {md_text(c)}" for c in compiled]  # fmt: skip
    return "\n".join(lines) + "\n"


LATENCY_HEADERS = ["model", "arm", "phase", "requests", "TTFT p50 / p90 / p99 ms", "TPOT p50 / p90 / p99 ms",
                   "ITL p50 / p99 ms", "E2EL p50 / p99 ms", "goodput req/s", "SLO attainment"]  # fmt: skip


def latency_rows(run: dict) -> list[list[str]]:
    """Per timed cell (decode, TTFT phases, each concurrency, long context): its requests' latency percentiles
    (the JSON's {median,p90,p99}_{ttft,tpot,itl,e2el}_ms) and, with SLOs, goodput and attainment."""
    def pcts(m: dict, name: str, which=("median", "p90", "p99")) -> str:
        values = [m.get(f"{w}_{name}_ms") for w in which]
        return "-" if all(v is None for v in values) else " / ".join(fmt(v, ".0f" if (v or 0) >= 100 else ".1f") for v in values)

    slos = bool(run["settings"].get("goodput"))
    out = []
    for mrun in run.get("models", []):
        for arm in mrun.get("arms", []):
            for cell in arm.get("cells", []):
                m = cell.get("metrics") or {}
                if cell["phase"] in ("warmup", "probe") or cell["status"] not in (MEASURED, RECOVERED):
                    continue
                out.append([mrun["model"], arm["arm"], cell["phase"], str(m.get("completed", "-")), pcts(m, "ttft"),
                            pcts(m, "tpot"), pcts(m, "itl", ("median", "p99")), pcts(m, "e2el", ("median", "p99")),
                            fmt(m.get("request_goodput"), ".3g") if slos else "-",
                            f"{m['slo_attainment']:.0%}" if slos and m.get("slo_attainment") is not None else "-"])  # fmt: skip
    return out


def load_lines(run: dict) -> list[str]:
    """Per arm with rate cells: each offered rate's achieved requests/s, output tok/s and TTFT, the saturation
    point (`arrivals.saturated`: the first rate at which the arm was saturated) and, with SLOs, the highest rate
    whose attainment stayed at `slo_target`; per arm with a shared-prefix cell: its groups' first TTFT against the
    rest's, and the cached tokens; each cell's prefill rate; the chat probe's verdicts. A sweep that ended on a burst
    (`arrivals.is_burst`) says so."""
    from harness.arrivals import is_burst, saturated

    target = run["settings"].get("slo_target", 0.9)
    slos = bool(run["settings"].get("goodput"))
    out = []
    for mrun in run.get("models", []):
        chat = (mrun.get("parity") or {}).get("chat") or {}
        if chat.get("verdicts"):
            out.append(f"{mrun['model']} / chat probe (first chat reply and prompt tokens against {chat['reference']}): " + "; ".join(
                f"{arm}: {v['compared']}" if v["match"] is None else
                f"{arm}: {'same' if v['match'] else 'DIFFERS'} ({v.get('prompt_tokens')} prompt tokens)"
                for arm, v in chat["verdicts"].items()))  # fmt: skip
        for arm in mrun.get("arms", []):
            name = f"{mrun['model']} / {arm['arm']}"
            cells = [c for c in arm.get("cells", []) if c["phase"].startswith("rate-") and c["status"] in (MEASURED, RECOVERED)]
            if cells:
                steps = ", ".join(f"{c['metrics']['offered_rate']:g} -> {fmt(c['metrics'].get('request_throughput'), '.2f')} req/s "
                                  f"{fmt(c['metrics'].get('output_throughput'), '.1f')} tok/s TTFT {fmt(c['metrics'].get('median_ttft_ms'), '.0f')} ms"
                                  for c in cells)  # fmt: skip
                knee = next((c for i, c in enumerate(cells, 1) if saturated(
                    [x["metrics"].get("output_throughput") for x in cells[:i]], [x["metrics"].get("median_ttft_ms") for x in cells[:i]])), None)  # fmt: skip
                bursts = [c for c in cells if is_burst([r["sent_at"] for a in c["attempts"] if a["ok"] for r in a["requests"]],
                                                       c["metrics"].get("median_e2el_ms"))]  # fmt: skip
                line = f"{name}: offered -> achieved: {steps}; " + (
                    f"saturated at {knee['metrics']['offered_rate']:g} req/s (throughput no higher than at the rate "
                    "before while TTFT climbed)" if knee else "not saturated at the rates measured")  # fmt: skip
                if bursts and not knee:
                    b = bursts[0]["metrics"]
                    sent = sum(len(a["requests"]) for a in bursts[0]["attempts"] if a["ok"])
                    line += (f" (from {b['offered_rate']:g} req/s on, a cell's {sent} requests arrived within their "
                             f"median E2EL of {b['median_e2el_ms'] / 1e3:.1f} s: a burst, not a sustained rate; more "
                             "--rate-requests load higher rates)")  # fmt: skip
                if slos:
                    held = [c["metrics"]["offered_rate"] for c in cells if (c["metrics"].get("slo_attainment") or 0) >= target]
                    line += (f"; highest rate with SLO attainment >= {target:.0%}: {max(held):g} req/s" if held
                             else f"; no rate kept SLO attainment >= {target:.0%}")  # fmt: skip
                out.append(line)
            chat = next((c for c in arm.get("cells", []) if c["phase"] == "multiturn" and c["status"] in (MEASURED, RECOVERED)), None)
            if chat:
                m = chat["metrics"]
                turns = "; ".join(f"turn {t + 1}: {ms:.0f} ms, {cached} of {prompt} prompt tokens cached" for t, (ms, cached, prompt)
                                  in enumerate(zip(m["turn_ttft_ms"], m["turn_cached_tokens"], m["turn_prompt_tokens"])))  # fmt: skip
                out.append(f"{name} / multiturn (median TTFT over the chats): {turns}")
            for c in arm.get("cells", []):
                m = c.get("metrics") or {}
                if c["status"] in (MEASURED, RECOVERED) and m.get("median_prefill_tps") is not None:
                    out.append(f"{name} / {c['phase']}: prefill {m['median_prefill_tps']:,.0f} prompt tok/s (median over "
                               f"{m['completed']}), TTFT p50 {fmt(m.get('median_ttft_ms'), '.0f')} ms p99 "
                               f"{fmt(m.get('p99_ttft_ms'), '.0f')} ms, TPOT p50 {fmt(m.get('median_tpot_ms'), '.1f')} ms")  # fmt: skip
            prefix = next((c for c in arm.get("cells", []) if c["phase"] == "prefix" and c["status"] in (MEASURED, RECOVERED)), None)
            if prefix:
                m = prefix["metrics"]
                out.append(f"{name} / prefix: a group's first request TTFT {fmt(m.get('median_first_ttft_ms'), '.0f')} ms, "
                           f"the others {fmt(m.get('median_shared_ttft_ms'), '.0f')} ms, cached tokens "
                           f"{sum(x or 0 for x in m.get('cached_tokens') or [])}")  # fmt: skip
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
                if cell["phase"] not in ("warmup", "probe") and mt.get("slo_attainment") is not None:
                    out.append(f"{m['model']} / {arm['arm']} / {cell['phase']}: goodput {mt['request_goodput']:g} "
                               f"req/s, attainment {mt['slo_attainment']:.0%} of {mt['requests']}")  # fmt: skip
    return out


def quality_lines(run: dict) -> list[str]:
    """'model / arm: held-out perplexity P over N tokens (tier T)' for each engine arm that measured it."""
    out = []
    for m in run.get("models", []):
        for arm in m.get("arms", []):
            q = arm.get("quality")
            if q and "perplexity" in q:
                out.append(f"{m['model']} / {arm['arm']}: held-out perplexity {q['perplexity']:g} over {q['tokens']} "
                           f"tokens ({q['tier']} tier)")  # fmt: skip
            elif q:
                out.append(f"{m['model']} / {arm['arm']}: held-out perplexity not measured ({q.get('error')})")
    return out


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
