"""A server's own counters around a cell: its `/metrics` (Prometheus text) read before and after, the change kept.

vLLM's names where a server has them (`vllm:prefix_cache_hits_total`, `vllm:spec_decode_num_accepted_tokens_total`,
`vllm:prompt_tokens_total`, ...; `engine serve` exposes them too): what the server says it did during the cell,
beside what the harness timed. Every sample of a counter, and of a histogram's `_count` and `_sum`, is kept by its
name and labels; a server without `/metrics` (mlx_lm.server) gives none.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

KINDS = ("counter", "histogram", "summary", "unknown")  # unknown: a sample the text's TYPE lines do not name


def read(client: httpx.Client) -> dict[str, float] | None:
    """The server's counters now, {name{labels}: value}; None when it serves no Prometheus text at /metrics."""
    try:
        r = client.get("/metrics")
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    out = {}
    for family in families:
        if family.type not in KINDS:
            continue
        for s in family.samples:
            if s.name.endswith(("_total", "_count", "_sum")) or (
                family.type == "counter" and not s.name.endswith("_created")
            ):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What changed between two reads (counters a server created in between count from 0); None without both."""
    if before is None or after is None:
        return None
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items() if v != before.get(k, 0.0)}
