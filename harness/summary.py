"""The table a person reads at the end of a run: per model, one row per arm.

    decode tok/s   median over the decode phase's requests (1000 / TPOT)
    TTFT cold/warm median TTFT of the cold and warm phases, ms
    agg@C          output tokens per second with C requests at once
    peak RSS       of the server's whole process tree
    x mlx-lm       decode rate / the mlx-lm arm's (only when both did the same work)
    roofline       decode rate / (memory bandwidth / weight bytes), where the bandwidth is known
    kernels        the kernel tier an engine arm's server reported (/stats); - for other servers
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from harness.records import MEASURED, RECOVERED

FAST_TIER = "fast"  # engine.kernels.FAST, named here so the summary stays free of the engine's imports

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


def same_work(a: dict, b: dict, phase: str) -> Optional[str]:
    """None when both arms did the same work in `phase` (same prompts, output counts, finish reasons); else why not."""
    ca, cb = cell_of(a, phase), cell_of(b, phase)
    if ca is None or cb is None:
        return "not measured on both"
    ra, rb = ok_requests(ca), ok_requests(cb)
    if [r["prompt_tokens_sent"] for r in ra] != [r["prompt_tokens_sent"] for r in rb]:
        return "different prompts"
    if [r["output_tokens"] for r in ra] != [r["output_tokens"] for r in rb]:
        return "different output counts"
    if [r["finish_reason"] for r in ra] != [r["finish_reason"] for r in rb]:
        return "different finish reasons"
    return None


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
            decode = metric(arm, "decode", "median_decode_tps")
            row = {
                "block": m["block"], "model": m["model"], "arm": arm["arm"], "status": arm["status"],
                "decode_tps": decode,
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
                why = same_work(arm, base, "decode")
                b = metric(base, "decode", "median_decode_tps")
                if why is None and decode and b:
                    row["vs_mlx_lm"] = round(decode / b, 4)
                else:
                    row["vs_mlx_lm_note"] = why or "no decode rate"
            out.append(row)
    return out


def fmt(x, spec: str = ".1f") -> str:
    """A number for a table cell; - when it is missing."""
    return "-" if x is None else format(x, spec)


def table_cells(r: dict, concurrency: list[str], blocks: bool = False) -> list[str]:
    parity = {True: "same", False: "differs (fast tier)" if r.get("probe_rounds") else "DIFFERS", None: "-"}[r["parity"]]
    ratio = fmt(r["vs_mlx_lm"], ".3f") if r["vs_mlx_lm"] is not None else (
        "-" if r["arm"] == "mlx-lm" else f"withheld ({r['vs_mlx_lm_note']})")
    return [*([str(r["block"])] if blocks else []), r["model"], r["arm"], r["status"], fmt(r["decode_tps"]), fmt(r["ttft_cold_ms"], ".0f"),
            fmt(r["ttft_warm_ms"], ".0f"), *[fmt(r["aggregate_tps"].get(c)) for c in concurrency],
            fmt(r["peak_rss_bytes"] / 2**20 if r["peak_rss_bytes"] else None, ".0f"), ratio,
            fmt(r["roofline"], ".1%"), parity, r.get("kernels") or "-"]  # fmt: skip


def headers(concurrency: list[str], blocks: bool = False) -> list[str]:
    return [*(["block"] if blocks else []), "model", "arm", "status", "decode tok/s", "TTFT cold ms", "TTFT warm ms",
            *[f"agg@{c} tok/s" for c in concurrency], "peak RSS MiB", "decode x mlx-lm", "roofline", "probe",
            "kernels"]  # fmt: skip


def concurrency_levels(rs: list[dict]) -> list[str]:
    return sorted({c for r in rs for c in r["aggregate_tps"]}, key=int)


def markdown(run: dict) -> str:
    rs = rows(run)
    conc, blocks = concurrency_levels(rs), run["kind"] == "trials"
    head = headers(conc, blocks)
    lines = [f"# Run {run['run_id']} ({run['created']})" + (" — DIAGNOSTIC (machine was busy)" if run["diagnostic"] else ""),
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    lines += ["| " + " | ".join(table_cells(r, conc, blocks)) + " |" for r in rs]
    return "\n".join(lines) + "\n"
