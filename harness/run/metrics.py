"""Cell metrics from request records, with the names vLLM's serving benchmark uses.

{mean,median,p90,p99}_{ttft,tpot,itl,e2el}_ms
output_throughput        output tokens / wall seconds of the cell
total_token_throughput   (prompt + output tokens) / wall seconds
median_decode_tps        median over requests of 1000 / TPOT
request_goodput          requests per second meeting every SLO given (none by default: all ok requests)
slo_attainment           the share of the cell's requests (failed ones included) meeting every SLO given;
                         None without SLOs
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harness.run.client import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")  # what an SLO can bound (vLLM's --goodput keys), in ms


def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "p90", "p99")}
    v = np.asarray(values, dtype=np.float64)
    return {
        f"mean_{name}_ms": round(float(v.mean()), 3),
        f"median_{name}_ms": round(float(np.median(v)), 3),
        f"p90_{name}_ms": round(float(np.percentile(v, 90)), 3),
        f"p99_{name}_ms": round(float(np.percentile(v, 99)), 3),
    }


def summarize(requests: Sequence[RequestRecord], wall_s: float, slo_ms: dict[str, float] | None = None) -> dict:
    """The cell's metrics; `slo_ms`: the SLOs a request must all meet to count as goodput ({"ttft": 2000, ...})."""
    if set(slo_ms or {}) - set(SLO_METRICS):
        raise ValueError(
            f"SLOs bound {', '.join(SLO_METRICS)}, not {', '.join(sorted(set(slo_ms) - set(SLO_METRICS)))}"
        )
    ok = [r for r in requests if r.ok]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or r.prompt_tokens_sent for r in ok)
    decode = [r.decode_tps for r in ok if r.decode_tps]
    slo = slo_ms or {}

    def meets(r: RequestRecord) -> bool:
        values = {"ttft": r.ttft_ms, "tpot": r.tpot_ms, "e2el": r.e2el_ms}
        return all(values[k] is not None and values[k] <= limit for k, limit in slo.items())

    metrics = {
        "requests": len(requests),
        "completed": len(ok),
        "wall_s": round(wall_s, 4),
        "output_tokens": out_tokens,
        "output_throughput": round(out_tokens / wall_s, 3) if wall_s > 0 else None,
        "total_token_throughput": round((out_tokens + prompt_tokens) / wall_s, 3) if wall_s > 0 else None,
        "median_decode_tps": round(float(np.median(decode)), 3) if decode else None,
        "decode_tps_samples": [round(x, 3) for x in decode],
        "request_goodput": round(sum(meets(r) for r in ok) / wall_s, 4) if wall_s > 0 else None,
        "slo_attainment": round(sum(meets(r) for r in ok) / len(requests), 4) if slo and requests else None,
        "cached_tokens": [r.cached_tokens for r in ok],
        "finish_reasons": sorted({r.finish_reason for r in ok if r.finish_reason}),
    }
    metrics |= _stats("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None])
    metrics |= _stats("tpot", [r.tpot_ms for r in ok if r.tpot_ms is not None])
    metrics |= _stats("itl", [x for r in ok for x in r.itl_ms])
    metrics |= _stats("e2el", [r.e2el_ms for r in ok if r.e2el_ms is not None])
    return metrics
