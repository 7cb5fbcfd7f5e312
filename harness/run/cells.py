"""The kinds of cell a benchmark run measures, one record each: its name (a phase, or the prefix of a family of
phases such as concurrency-C), how its requests go out, which endpoint takes them, what its metrics add, what
the report's serving matrix shows for it, and its rows in the verdict tables (`headline`). The run (`runner`),
the summary, the comparisons and the report read these records instead of matching phase names.

How each kind's prompts are built and its options stay with the workload (`workloads`) and the command line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.run.arrivals import offsets, rate_of_phase

# How a cell's requests go out (`runner.Runner._send`).
ALONE = "alone"  # one after another
FIRST_ALONE = "first alone"  # the first alone, then the rest at once
AT_ONCE = "at once"  # all at once
OPEN_LOOP = "open loop"  # arriving at the kind's `arrivals`, whether or not the earlier ones finished
PREFIX_GROUPS = "prefix groups"  # each group's first request alone, then the group's others at once
CHATS = "chats"  # the chats side by side, each one's turns one after another

# What the report's serving matrix shows for a measured cell (`report.page._cell_view`).
DECODE_RATE = "decode rate"  # median decode tok/s
TTFT = "ttft"  # median TTFT, and the prefill rate where the cell has one
THROUGHPUT = "throughput"  # aggregate output tok/s
ACHIEVED = "achieved"  # aggregate output tok/s and the request rate achieved


@dataclass(frozen=True)
class RatioMetric:
    """A row of the verdict tables: a metric of a kind of cell compared between two arms."""

    prefix: str  # a phase, or with a trailing '-' a family of them
    key: str  # the cells' metric
    label: str  # the table's name
    short: str  # the verdict line's name
    higher_is_better: bool
    unit: str

    def matches(self, phase: str) -> bool:
        return phase == self.prefix or (self.prefix.endswith("-") and phase.startswith(self.prefix))


@dataclass(frozen=True)
class CellKind:
    name: str  # a phase, or with a trailing '-' the prefix of a family of phases (concurrency-4, rate-2)
    send: str = ALONE
    chat: bool = False  # messages to /v1/chat/completions (the server's template makes the prompt)
    timed: bool = True  # False: the warm-up and the probe, left out of latency tables, exports and flags
    repeated: bool = False  # a load cell: measured again in each repetition block
    prefill_rate: bool = False  # its TTFT is mostly the prompt's prefill: its metrics add the prefill rate
    shows: str | None = TTFT
    # OPEN_LOOP: (phase, requests, the run's settings) -> (each request's offset in s, most in flight or None)
    arrivals: Callable[[str, int, Any], tuple[list[float], int | None]] | None = None
    trimmed: bool = False  # the first and last tenth of its requests are sent but left out of its metrics
    ratios: tuple[tuple[str, str, str, bool, str], ...] = ()  # (key, label, short, higher_is_better, unit)

    @property
    def family(self) -> bool:
        return self.name.endswith("-")

    def matches(self, phase: str) -> bool:
        return phase == self.name or (self.family and phase.startswith(self.name))

    def ratio_metrics(self) -> list[RatioMetric]:
        return [RatioMetric(self.name, *r) for r in self.ratios]


WARMUP = CellKind("warmup", send=FIRST_ALONE, timed=False)
PROBE = CellKind("probe", timed=False)
DECODE = CellKind("decode", shows=DECODE_RATE, ratios=(("median_decode_tps", "decode tok/s", "decode", True, "tok/s"),))
CHAT = CellKind(
    "chat",
    chat=True,
    shows=DECODE_RATE,
    ratios=(("median_decode_tps", "decode tok/s chat", "chat decode", True, "tok/s"),),
)
COLD = CellKind(
    "cold",
    prefill_rate=True,
    ratios=(
        ("median_ttft_ms", "TTFT cold", "cold TTFT", False, "ms"),
        ("median_prefill_tps", "prefill tok/s cold", "cold prefill", True, "tok/s"),
    ),
)
WARM = CellKind("warm", ratios=(("median_ttft_ms", "TTFT warm", "warm TTFT", False, "ms"),))
LONG = CellKind("long", prefill_rate=True, ratios=(("median_ttft_ms", "TTFT long", "long TTFT", False, "ms"),))
CONCURRENCY = CellKind(
    "concurrency-",
    send=AT_ONCE,
    repeated=True,
    shows=THROUGHPUT,
    ratios=(("output_throughput", "aggregate tok/s", "agg", True, "tok/s"),),
)
PREFIX = CellKind(
    "prefix", send=PREFIX_GROUPS, ratios=(("median_ttft_ms", "TTFT shared prefix", "shared-prefix TTFT", False, "ms"),)
)
MULTITURN = CellKind(
    "multiturn", send=CHATS, chat=True, ratios=(("median_ttft_ms", "TTFT multi-turn", "multi-turn TTFT", False, "ms"),)
)
STAGGERED = CellKind(
    "staggered",
    send=OPEN_LOOP,
    arrivals=lambda phase, n, settings: ([i * settings.stagger_s for i in range(n)], None),
    prefill_rate=True,
    ratios=(
        ("median_ttft_ms", "TTFT staggered", "staggered TTFT", False, "ms"),
        ("median_prefill_tps", "prefill tok/s staggered", "staggered prefill", True, "tok/s"),
    ),
)
RATE = CellKind(
    "rate-",
    send=OPEN_LOOP,
    arrivals=lambda phase, n, settings: (
        offsets(rate_of_phase(phase), n, settings.burstiness, settings.workload.seed),
        settings.max_concurrency,
    ),
    trimmed=True,
    repeated=True,
    shows=ACHIEVED,
    ratios=(("output_throughput", "aggregate tok/s", "agg", True, "tok/s"),),
)

# Every kind, in the order of the verdict tables' rows.
KINDS = (WARMUP, PROBE, DECODE, CHAT, COLD, WARM, LONG, CONCURRENCY, PREFIX, MULTITURN, STAGGERED, RATE)


def kind_of(phase: str) -> CellKind | None:
    """The kind of the cell of `phase`; None for a phase no kind names."""
    return next((k for k in KINDS if k.matches(phase)), None)


def timed(phase: str) -> bool:
    kind = kind_of(phase)
    return kind is None or kind.timed
