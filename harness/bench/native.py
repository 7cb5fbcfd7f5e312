"""In-process speed check: our engine and mlx-lm on the same artifact and prompt ids.

Both sides run in this process with fresh caches per request, greedy, fixed
output length. Warmups first (the first request compiles kernels), then
`samples` measured requests per side in alternating order (A B, B A, ...),
so a slow drift of the machine hits both sides alike. Reported per side: the
median prefill rate (prompt tokens / time to first token) and the median
decode rate ((tokens - 1) / time after the first token); ratios are
engine / mlx-lm; token identity compares the generated ids.

The engine side runs the kernel tier `NativeConfig.kernels` (mlx-lm stays
stock); the result records what ran (`KernelSet.as_record()`), which is the
exact tier wherever the fast one cannot run.

Medians of two noisy series can disagree with what happened pair by pair, so
each measured engine request is also paired with the mlx-lm request next to it
in time; the geometric mean and range of those paired ratios are reported. The
record keeps the machine's load before and after the samples (`machine`), and
the command prints any problem `harness.run.preflight` sees there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from engine.device import device_label
from engine.generate import generate
from engine.kernels import AUTO, EXACT, KernelConfig, KernelSet, install
from engine.loading import load_model
from engine.request import StopCriteria
from harness.gates.parity import vocab_size
from harness.run import preflight
from oracles import reference
from oracles.cases import frozen_prompt_ids

ENGINE, MLX_LM = "engine", "mlx-lm"
PREFLIGHT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class NativeConfig:
    prompt_tokens: int = 1024
    decode_tokens: int = 128
    samples: int = 5
    warmup: int = 1
    seed: int = 0
    kernels: str = AUTO  # the engine side's kernel tier (with ENGINE_FUSE / ENGINE_GEMV_LAUNCH where set)

    def __post_init__(self):
        if self.decode_tokens < 2:
            raise ValueError(
                f"decode_tokens must be at least 2 (a decode rate needs two tokens), got {self.decode_tokens}"
            )


@dataclass(frozen=True)
class Sample:
    arm: str
    ttft_s: float
    tokens: tuple[int, ...]
    steps_s: tuple[float, ...] = ()  # the gaps between consecutive tokens after the first

    @property
    def decode_s(self) -> float:
        """From the first token to the last."""
        return sum(self.steps_s)

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.steps_s) * 1000 if self.steps_s else float("nan")

    @property
    def slowest_step_ms(self) -> float:
        return max(self.steps_s) * 1000 if self.steps_s else float("nan")


@dataclass
class ArmSummary:
    arm: str
    prefill_tps: float
    decode_tps: float
    ttft_ms: float
    samples_prefill_tps: list[float] = field(default_factory=list)
    samples_decode_tps: list[float] = field(default_factory=list)
    # per sample: the median gap between tokens and the slowest one. A decode rate well below
    # 1000 / median step means a few long stalls; near it, uniformly slower steps (a slower host).
    samples_median_step_ms: list[float] = field(default_factory=list)
    samples_slowest_step_ms: list[float] = field(default_factory=list)


@dataclass
class NativeResult:
    model: str
    device: str
    prompt_tokens: int
    decode_tokens: int
    engine: ArmSummary
    mlx_lm: ArmSummary
    tokens_identical: bool
    kernels: KernelSet  # what the engine side ran
    # harness.run.preflight snapshots just before the first sample and just after the last: both sides are
    # host-bound at B = 1 on CUDA, so a busy host moves the rates
    machine: dict = field(default_factory=dict)

    @property
    def is_exact(self) -> bool:
        """Whether token identity is the expectation (the fast tier agrees to rounding only)."""
        return self.kernels.tier == EXACT

    def paired_decode_ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.engine.samples_decode_tps, self.mlx_lm.samples_decode_tps)]

    def paired_prefill_ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.engine.samples_prefill_tps, self.mlx_lm.samples_prefill_tps)]

    @property
    def decode_ratio(self) -> float:
        return self.engine.decode_tps / self.mlx_lm.decode_tps

    @property
    def prefill_ratio(self) -> float:
        return self.engine.prefill_tps / self.mlx_lm.prefill_tps

    def as_record(self) -> dict:
        return {
            **asdict(self),  # `kernels` included: asdict recurses into the KernelSet
            "decode_ratio": self.decode_ratio,
            "prefill_ratio": self.prefill_ratio,
            "paired_decode_ratios": self.paired_decode_ratios(),
            "paired_prefill_ratios": self.paired_prefill_ratios(),
        }


def time_sample(arm: str, run: Callable[[], Iterator[int]]) -> Sample:
    mx.synchronize()
    start = time.perf_counter()
    tokens, stamps = [], []
    for token in run():
        stamps.append(time.perf_counter())
        tokens.append(token)
    mx.synchronize()
    steps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
    return Sample(arm, stamps[0] - start, tuple(tokens), steps)


def _engine_tokens(model, ids: Sequence[int], n: int):
    stop = StopCriteria(max_tokens=n, ignore_eos=True)
    return (t.token_id for t in generate(model, ids, stop=stop, cache=model.make_cache()))


def _mlx_lm_tokens(model, ids: Sequence[int], n: int):
    steps = generate_step(mx.array(list(ids)), model, max_tokens=n, prompt_cache=make_prompt_cache(model))
    return (int(tok) for tok, _ in steps)


def _summarize(arm: str, samples: list[Sample], prompt_tokens: int, decode_tokens: int) -> ArmSummary:
    prefill = [prompt_tokens / s.ttft_s for s in samples]
    decode = [(decode_tokens - 1) / s.decode_s for s in samples]
    return ArmSummary(
        arm=arm,
        prefill_tps=statistics.median(prefill),
        decode_tps=statistics.median(decode),
        ttft_ms=statistics.median(s.ttft_s for s in samples) * 1000,
        samples_prefill_tps=prefill,
        samples_decode_tps=decode,
        samples_median_step_ms=[s.median_step_ms for s in samples],
        samples_slowest_step_ms=[s.slowest_step_ms for s in samples],
    )


def run_native(
    name: str,
    path: Path,
    cfg: NativeConfig,
    on_sample: Callable[[Sample], None] | None = None,
) -> NativeResult:
    ours, config = load_model(path)
    kernels = install(ours, KernelConfig.from_env(cfg.kernels), family=config.get("model_type"))
    theirs = reference.load_model(path)
    ids = frozen_prompt_ids(cfg.prompt_tokens, vocab_size(path), cfg.seed)
    n = cfg.decode_tokens
    arms = {
        ENGINE: lambda: _engine_tokens(ours, ids, n),
        MLX_LM: lambda: _mlx_lm_tokens(theirs, ids, n),
    }
    for _ in range(cfg.warmup):
        for arm in (ENGINE, MLX_LM):
            time_sample(arm, arms[arm])
    samples: dict[str, list[Sample]] = {ENGINE: [], MLX_LM: []}
    before = preflight.check(PREFLIGHT_INTERVAL_S).as_record()
    for i in range(cfg.samples):
        order = (ENGINE, MLX_LM) if i % 2 == 0 else (MLX_LM, ENGINE)
        for arm in order:
            s = time_sample(arm, arms[arm])
            samples[arm].append(s)
            if on_sample:
                on_sample(s)
    identical = all(s.tokens == samples[ENGINE][0].tokens for s in samples[ENGINE] + samples[MLX_LM])
    return NativeResult(
        model=name,
        device=device_label(),
        prompt_tokens=cfg.prompt_tokens,
        decode_tokens=n,
        engine=_summarize(ENGINE, samples[ENGINE], cfg.prompt_tokens, n),
        mlx_lm=_summarize(MLX_LM, samples[MLX_LM], cfg.prompt_tokens, n),
        tokens_identical=identical,
        kernels=kernels,
        machine={"before": before, "after": preflight.check(PREFLIGHT_INTERVAL_S).as_record()},
    )
