"""The kinds of cell a benchmark run measures, one record each: its name (a phase, or the prefix of a family of
phases such as concurrency-C), how its requests go out, which endpoint takes them, what its metrics add, what
the report's serving matrix shows for it, and its rows in the verdict tables (`headline`). The run (`runner`),
the summary, the comparisons and the report read these records instead of matching phase names.

A kind may also carry its command-line options (`Option`: the run's parser adds them, the run's and the
workload's settings get a field for each, `with_options`), its phases in a run and how its prompts are built
(`workloads` calls them); the kinds that do not are built by name in `workloads` and the command line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from harness.cli_common import non_negative, positive, positive_float
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


# Which settings hold an option's value (`with_options`).
WORKLOAD = "workload"  # it shapes the prompts: a field of workloads.WorkloadSettings, recorded with the workload
RUN = "run"  # it shapes how they are sent: a field of runner.RunSettings

# prompt(phase, attempt, index, length): `length` token ids of the workload's text opened by the request's nonce
Prompt = Callable[[str, int, int, int], list[int]]


@dataclass(frozen=True)
class Option:
    """A command-line option of `harness run all` and `harness trials` that a kind of cell declares, and the
    settings field of the same name (`dest`) that holds its value."""

    flag: str
    dest: str  # the field of the settings (`scope`) and of the parsed arguments
    type: Callable[[str], Any]
    default: Any
    metavar: str
    help: str
    scope: str = WORKLOAD


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
    options: tuple[Option, ...] = ()  # its own command-line options and settings fields
    # Where the record builds its cells: (the workload's settings) -> its phases in a run (measured after the other
    # kinds' cells, before the long-context one), and (prompt, the workload's settings, attempt) -> a phase's
    # prompts, drawn from the workload's text after the other kinds' (so that adding a kind leaves theirs as they
    # were)
    phases: Callable[[Any], list[str]] | None = None
    prompts: Callable[[Prompt, Any, int], list] | None = None

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
    options=(
        Option(
            "--staggered",
            "staggered",
            non_negative,
            0,
            "N",
            "a staggered cell: N long prompts (--staggered-tokens) arriving --stagger seconds apart, each decoding "
            "--tokens while the next prefills: TTFT and prefill rate under load; 0: none (default)",
        ),
        Option(
            "--staggered-tokens",
            "staggered_tokens",
            positive,
            2048,
            "P",
            "prompt tokens of each staggered request (default 2048)",
        ),
        Option(
            "--stagger",
            "stagger_s",
            positive_float,
            2.0,
            "SECONDS",
            "seconds between the staggered cell's arrivals (default 2)",
            scope=RUN,
        ),
    ),
    phases=lambda settings: ["staggered"] * bool(settings.staggered),
    prompts=lambda prompt, settings, attempt: [
        prompt("staggered", attempt, i, settings.staggered_tokens) for i in range(settings.staggered)
    ],
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


def options(scope: str) -> list[Option]:
    """The kinds' options whose values the settings of `scope` hold, in the kinds' order."""
    return [o for k in KINDS for o in k.options if o.scope == scope]


def with_options(base: type, scope: str) -> type:
    """`base` (a frozen dataclass of settings, `scope`'s) with a field for each kind's option of that scope, named
    by its `dest`, after base's own fields: the settings keep one flat field an option, as their JSON does."""
    extra = [(o.dest, Any, field(default=o.default)) for o in options(scope)]
    settings = make_dataclass(base.__name__, extra, bases=(base,), frozen=True)
    settings.__module__, settings.__qualname__, settings.__doc__ = base.__module__, base.__qualname__, base.__doc__
    return settings


def option_values(args: Any, scope: str) -> dict[str, Any]:
    """The parsed command line's values of the kinds' options of `scope`, by settings field."""
    return {o.dest: getattr(args, o.dest) for o in options(scope)}
