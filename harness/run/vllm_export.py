"""A run's timed cells in vLLM's `vllm bench serve` result keys (`harness run all --export vllm`).

One object a model, arm and timed cell, with the keys vLLM 0.31's `benchmarks/serve.py` saves (its
`--save-result` JSON): the run's settings (date, backend, model_id, tokenizer_id, num_prompts, request_rate,
burstiness, max_concurrency), the totals and rates (duration, completed, failed, total_input_tokens,
total_output_tokens, request_throughput, request_goodput, output_throughput, total_token_throughput), the
per-request lists (input_lens, output_lens, ttfts and itls in seconds, generated_texts, errors) and
mean / median / std / p99 of TTFT, TPOT, ITL and E2EL in ms. Tools that read vLLM's results read these.
"""

from __future__ import annotations

import math

import numpy as np

from harness.run import cells
from harness.run.measured import ok_requests
from harness.run.records import MEASURED, RECOVERED

METRICS = ("ttft", "tpot", "itl", "e2el")
KEYS = (
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    *(f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "std", "p99")),
)


def _stats(name: str, values: list[float]) -> dict[str, float | None]:
    v = np.asarray(values, dtype=np.float64)
    if not v.size:
        return {f"{s}_{name}_ms": 0.0 for s in ("mean", "median", "std", "p99")}  # vLLM reports 0 for none
    return {
        f"mean_{name}_ms": float(v.mean()),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(v.std()),
        f"p99_{name}_ms": float(np.percentile(v, 99)),
    }


def cell_result(run: dict, model: dict, arm: dict, cell: dict) -> dict:
    """One measured cell as vLLM's result object."""
    m = cell["metrics"]
    window = m.get("measured_requests")
    attempt = next(a for a in reversed(cell["attempts"]) if a["ok"])
    reqs = attempt["requests"][window[0] : window[1]] if window else attempt["requests"]
    ok = [r for r in reqs if r["ok"]]
    rate = m.get("offered_rate", math.inf if cell["phase"].startswith("concurrency-") else None)  # vLLM's inf: at once
    concurrency = (
        int(cell["phase"].split("-", 1)[1]) if cell["phase"].startswith("concurrency-") else m.get("max_concurrency")
    )
    duration = m["wall_s"]
    out = {
        "date": run["created"],
        "backend": "openai",
        "model_id": (arm.get("endpoint") or {}).get("model_id") or model["model"],
        "tokenizer_id": model["model_dir"],
        "num_prompts": len(reqs),
        "request_rate": "inf" if rate == math.inf else rate,
        "burstiness": m.get("burstiness", 1.0),
        "max_concurrency": concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "total_input_tokens": sum(r.get("prompt_tokens") or r["prompt_tokens_sent"] for r in ok),
        "total_output_tokens": sum(r.get("output_tokens") or 0 for r in ok),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": m.get("request_goodput") if run["settings"].get("goodput") else None,
        "output_throughput": m.get("output_throughput"),
        "total_token_throughput": m.get("total_token_throughput"),
        "input_lens": [r["prompt_tokens_sent"] for r in reqs],
        "output_lens": [r.get("output_tokens") or 0 for r in reqs],
        "ttfts": [(r.get("ttft_ms") or 0.0) / 1e3 for r in reqs],
        "itls": [[x / 1e3 for x in r.get("itl_ms") or []] for r in reqs],
        "generated_texts": [r.get("text", "") for r in reqs],
        "errors": [r.get("error") or "" for r in reqs],
    }
    out |= _stats("ttft", [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None])
    out |= _stats("tpot", [r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None])
    out |= _stats("itl", [x for r in ok for x in r.get("itl_ms") or []])
    out |= _stats("e2el", [r["e2el_ms"] for r in ok if r.get("e2el_ms") is not None])
    return {
        "harness": {
            "run_id": run["run_id"],
            "model": model["model"],
            "arm": arm["arm"],
            "phase": cell["phase"],
            "block": model["block"],
        },
        **{k: out[k] for k in KEYS},
    }


def export(run: dict) -> list[dict]:
    """Every measured timed cell (not the warm-up or the probe) of a run record, as vLLM's result objects."""
    return [
        cell_result(run, model, arm, cell)
        for model in run["models"]
        for arm in model["arms"]
        for cell in arm["cells"]
        if cells.timed(cell["phase"]) and cell["status"] in (MEASURED, RECOVERED) and ok_requests(cell)
    ]
