"""Scheduler overhead benchmark, in process (not a timed test: the ratios are the result).

1. Lone request: the same request through the serial lane (engine.generate)
   and through the continuous batcher; decode tok/s after the first token.
   The batcher's single row runs the serial graph, so this measures what the
   scheduling machinery costs per token (target: ratio >= 0.99).
2. Concurrency C: C requests arrive at once (distinct frozen prompts of equal
   length, fixed output length); aggregate output tok/s = all generated
   tokens / wall time from submission to the last token, ours against mlx-lm's
   BatchGenerator as mlx_lm.server runs it (prefill_batch_size 8, the same
   schedule as ours, so at the exact tier the generated ids must be
   identical); and the decode step at C rows: the median time between a
   row's tokens while all C rows decode (after the last one's first token,
   before the first one's last), beside the one-row step of part 1.

The engine side runs the kernel tier `BatchBenchConfig.kernels` (mlx-lm stays
stock); off the exact tier the ids may differ by rounding.

Sides alternate sample by sample; medians and per-pair ratios are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.generate import generate
from engine.kernels import AUTO, KernelConfig, KernelSet, install
from engine.loading import load_model
from engine.request import GenerationRequest, StopCriteria
from engine.sinks import CollectingSink
from harness.gates.parity import vocab_size
from harness.run.stats import geomean
from oracles.cases import frozen_prompt_ids
from oracles.reference import load_model as load_reference


@dataclass(frozen=True)
class BatchBenchConfig:
    prompt_tokens: int = 128
    decode_tokens: int = 128
    concurrency: tuple[int, ...] = (4, 8)
    samples: int = 3
    warmup: int = 1
    seed: int = 0
    prefill_batch: int = 8  # both sides (mlx_lm.server's --prompt-concurrency)
    kernels: str = AUTO  # the engine side's kernel tier (with ENGINE_FUSE / ENGINE_GEMV_LAUNCH where set)


@dataclass
class Series:
    name: str
    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass
class Comparison:
    label: str
    unit: str
    ours: Series
    baselines: list[Series]
    tokens_identical: bool | None = None

    def ratio(self, baseline: Series) -> float:
        return self.ours.median / baseline.median

    def paired(self, baseline: Series) -> list[float]:
        return [a / b for a, b in zip(self.ours.values, baseline.values)]

    def as_record(self) -> dict:
        return {
            **asdict(self),
            "ratios": {b.name: self.ratio(b) for b in self.baselines},
            "paired_geomean": {b.name: geomean(self.paired(b)) for b in self.baselines},
        }


def _lone_serial(model, prompt, n) -> float:
    it = generate(model, prompt, stop=StopCriteria(max_tokens=n, ignore_eos=True))
    next(it)
    start = time.perf_counter()
    count = sum(1 for _ in it)
    return count / (time.perf_counter() - start)


def _lone_batched(model, prompt, n) -> float:
    stamps = []

    class Clock(CollectingSink):
        def on_token(self, token):
            stamps.append(time.perf_counter())
            return True

    b = ContinuousBatcher(model, SchedulerConfig(max_rows=8))
    b.submit(GenerationRequest("lone", tuple(prompt), stop=StopCriteria(max_tokens=n, ignore_eos=True)), Clock())
    b.run_until_idle()
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


@dataclass
class Concurrent:
    """One concurrent run: aggregate tok/s, each row's ids, and the decode step at all rows (ms)."""

    rate: float
    tokens: list[list[int]]
    step_ms: float


def full_batch_step_ms(stamps: list[list[float]]) -> float:
    """The median time between a row's consecutive tokens while every row decodes: from the last row's
    first token to the first row's last (nan where that window holds no two tokens of a row)."""
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if a >= start and b <= end]
    return statistics.median(gaps) * 1e3 if gaps else float("nan")


class _StampSink(CollectingSink):
    def __init__(self):
        super().__init__()
        self.stamps: list[float] = []

    def on_token(self, token):
        self.stamps.append(time.perf_counter())
        return super().on_token(token)


def _ours_concurrent(model, prompts, n, prefill_batch: int) -> Concurrent:
    b = ContinuousBatcher(model, SchedulerConfig(max_rows=len(prompts), prefill_batch=prefill_batch))
    sinks = [_StampSink() for _ in prompts]
    start = time.perf_counter()
    for i, (p, s) in enumerate(zip(prompts, sinks)):
        b.submit(GenerationRequest(f"c{i}", tuple(p), stop=StopCriteria(max_tokens=n, ignore_eos=True)), s)
    b.run_until_idle()
    wall = time.perf_counter() - start
    return Concurrent(
        sum(len(s.tokens) for s in sinks) / wall,
        [s.token_ids for s in sinks],
        full_batch_step_ms([s.stamps for s in sinks]),
    )


def _mlx_lm_concurrent(model, prompts, n, prefill_batch_size) -> Concurrent:
    gen = BatchGenerator(
        model, max_tokens=n, prefill_batch_size=prefill_batch_size, completion_batch_size=max(32, len(prompts))
    )
    start = time.perf_counter()
    uids = gen.insert([list(p) for p in prompts], max_tokens=[n] * len(prompts))
    out = {u: [] for u in uids}
    stamps = {u: [] for u in uids}
    done = 0
    while done < len(prompts):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
            stamps[r.uid].append(time.perf_counter())
            done += r.finish_reason is not None
    wall = time.perf_counter() - start
    gen.close()
    return Concurrent(
        sum(len(v) for v in out.values()) / wall, [out[u] for u in uids], full_batch_step_ms([stamps[u] for u in uids])
    )


def _alternate(sides: dict[str, Callable[[], float]], samples: int, warmup: int) -> dict[str, Series]:
    for _ in range(warmup):
        for f in sides.values():
            f()
    series = {k: Series(k) for k in sides}
    names = list(sides)
    for i in range(samples):
        for k in names if i % 2 == 0 else reversed(names):
            mx.synchronize()
            series[k].values.append(sides[k]())
    return series


def run_batch_bench(
    path: Path,
    cfg: BatchBenchConfig,
    log: Callable[[str], None] = lambda _: None,
    on_kernels: Callable[[KernelSet], None] = lambda _: None,
) -> list[Comparison]:
    """The comparisons above on the artifact at `path`; `on_kernels` hears the tier the engine side runs."""
    ours, config = load_model(path)
    kernels = install(ours, KernelConfig.from_env(cfg.kernels), family=config.get("model_type"))
    on_kernels(kernels)
    theirs = load_reference(path)
    vocab = vocab_size(path)
    n = cfg.decode_tokens
    out = []
    lone = frozen_prompt_ids(cfg.prompt_tokens, vocab, cfg.seed)
    log("lone request: continuous vs serial lane")
    s = _alternate(
        {"continuous": lambda: _lone_batched(ours, lone, n), "serial": lambda: _lone_serial(ours, lone, n)},
        cfg.samples,
        cfg.warmup,
    )
    out.append(Comparison("1 request, decode", "tok/s", s["continuous"], [s["serial"]]))
    one_row = Series("continuous, 1 row", [1e3 / v for v in s["continuous"].values])
    for c in cfg.concurrency:
        prompts = [frozen_prompt_ids(cfg.prompt_tokens, vocab, cfg.seed + 1 + i) for i in range(c)]
        log(f"{c} concurrent requests: engine vs mlx-lm BatchGenerator")
        tokens: dict[str, list] = {}
        steps: dict[str, Series] = {"engine": Series("engine"), "mlx-lm": Series("mlx-lm")}

        def side(name, fn):
            def run():
                result = fn()
                tokens[name] = result.tokens
                steps[name].values.append(result.step_ms)
                return result.rate

            return run

        p = cfg.prefill_batch
        s = _alternate(
            {
                "engine": side("engine", lambda: _ours_concurrent(ours, prompts, n, p)),
                "mlx-lm": side("mlx-lm", lambda: _mlx_lm_concurrent(theirs, prompts, n, p)),
            },
            cfg.samples,
            cfg.warmup,
        )
        identical = tokens["engine"] == tokens["mlx-lm"]
        out.append(Comparison(f"{c} concurrent, aggregate", "tok/s", s["engine"], [s["mlx-lm"]], identical))
        # the warmup's steps are not samples
        measured = {k: Series(k, v.values[-cfg.samples :]) for k, v in steps.items()}
        out.append(Comparison(f"{c} rows, decode step", "ms", measured["engine"], [measured["mlx-lm"], one_row]))
    return out
