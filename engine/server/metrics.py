"""`/metrics`: the server's counters, gauges and latency histograms in Prometheus' text format.

Names follow vLLM's where one exists (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, ...), so dashboards built for vLLM read
this server too; the rest are the engine's own, under `engine:`. Counters
and gauges are read from the worker's snapshot at each scrape; the
histograms hear every request's end (`observe_end`, on the engine thread).
The registry is the server's own, not prometheus_client's global one.
Importing this module needs prometheus_client; the server runs without it
(and answers /metrics with a 501).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.request import RequestResult

# seconds; vLLM's buckets for the same histograms, trimmed
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class _Snapshot:
    """A collector of the counters and gauges in the worker's snapshot at the scrape."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        snap, name = self.metrics.snapshot, self.metrics.model_name
        batch, totals, pc = snap.get("batch", {}), snap.get("totals", {}), snap.get("prompt_cache") or {}

        def gauge(metric: str, doc: str, value: float):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        waiting = batch.get("waiting_requests", 0)
        budget, kv = batch.get("kv_budget_bytes"), batch.get("kv_bytes", 0)
        yield gauge(
            "vllm:num_requests_running",
            "Requests started and not ended.",
            max(batch.get("live_requests", 0) - waiting, 0),
        )
        yield gauge("vllm:num_requests_waiting", "Requests queued, not yet started.", waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache bytes over the --kv-budget (0 without a budget).",
            kv / budget if budget else 0.0,
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", totals.get("prompt_tokens", 0)
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", totals.get("cached_tokens", 0)
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens of the requests accepted.", totals.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Tokens generated.", totals.get("completion_tokens", 0))
        yield counter("vllm:spec_decode_num_drafts", "Speculative rounds.", totals.get("spec_rounds", 0))
        yield counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted.", totals.get("spec_drafted", 0))
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", totals.get("spec_accepted", 0)
        )
        requests = CounterMetricFamily("engine:requests", "Requests by how they ended.", labels=["model_name", "end"])
        for end in ("completed", "cancelled", "errors", "rejected"):
            requests.add_metric([name, end], totals.get(end, 0))
        yield requests
        yield gauge("engine:kv_cache_bytes", "Bytes of KV cache the batch holds.", kv)
        yield gauge("engine:active_rows", "Rows in the continuous batch.", batch.get("active_rows", 0))
        yield gauge("engine:prompt_cache_bytes", "Bytes the prefix cache holds.", pc.get("bytes", 0))
        hits = CounterMetricFamily(
            "engine:prompt_cache_hits",
            "Prefix cache hits by what served them: a stored "
            "request's boundary (entry) or a block snapshot inside it (block).",
            labels=["model_name", "kind"],
        )
        hits.add_metric([name, "entry"], pc.get("hits", 0) - pc.get("block_hits", 0))
        hits.add_metric([name, "block"], pc.get("block_hits", 0))
        yield hits
        yield counter(
            "engine:prompt_cache_disk_hits", "Prefix cache entries loaded from the disk tier.", pc.get("disk_hits", 0)
        )
        yield gauge(
            "engine:prompt_cache_disk_bytes", "Bytes the prefix cache's disk tier holds.", pc.get("disk_bytes", 0)
        )


class Metrics:
    """The server's Prometheus registry for one served model."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict[str, Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)

        def histogram(metric: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(metric, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Submission to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Submission to the end.", REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Submission to start.", REQUEST_BUCKETS)
        self.registry.register(_Snapshot(self))

    def observe_end(self, result: RequestResult, times, token_gaps: Sequence[float]) -> None:
        """One request's latencies (`times`: the worker's Timings stamps, seconds)."""
        if times.started is not None:
            self.queue.observe(times.started - times.submitted)
        if times.first_token is not None:
            self.ttft.observe(times.first_token - times.submitted)
        for gap in token_gaps:
            self.itl.observe(gap)
        self.e2e.observe((times.ended or time.perf_counter()) - times.submitted)  # heard just before the stamp

    def exposition(self, snapshot: dict[str, Any]) -> tuple[bytes, str]:
        """(the text format's body, its content type) with the counters and gauges of `snapshot`."""
        self.snapshot = snapshot
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
