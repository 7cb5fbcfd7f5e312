"""The B=1 parity gate: our engine against mlx-lm on the same artifact and prompt ids.

For each case both sides generate greedily from the same prompt ids. mlx-lm's
`generate_step` makes steps + 1 forwards (it launches one past the last token
it yields), so the engine runs steps + 1 tokens and every forward's full
float32 logit vector is compared, then the cache arrays both hold at the end.
The requirement is max |difference| == 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine import loading
from engine.generate import KVQuantization, generate
from engine.loading import load_config, load_model
from engine.request import StopCriteria
from engine.synth import ensure_model
from oracles import reference
from oracles.cases import DEFAULT_STEPS, DTYPES, PROMPT_LENGTHS, frozen_prompt_ids, model_name


@dataclass(frozen=True)
class ParityCase:
    model: str  # registry name including the variant (e.g. tiny-qwen35-4bit), or a label
    prompt_len: int
    steps: int = DEFAULT_STEPS
    seed: int = 0  # artifact seed; the prompt ids derive from it too
    kv_bits: int | None = None
    kv_group_size: int = 32
    model_path: str | None = None  # an mlx-lm directory instead of a registry name

    @property
    def label(self) -> str:
        kv = f" kv{self.kv_bits}g{self.kv_group_size}" if self.kv_bits else ""
        return f"{self.model} L={self.prompt_len} steps={self.steps}{kv}"


@dataclass(frozen=True)
class ParityResult:
    case: ParityCase
    max_abs_diff: float
    first_diff_step: int | None
    tokens_equal: bool
    cache_max_abs_diff: float
    compared_steps: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff == 0.0 and self.tokens_equal and self.cache_max_abs_diff == 0.0

    def as_record(self) -> dict:
        return {**asdict(self.case), **{k: v for k, v in asdict(self).items() if k != "case"}, "passed": self.passed}


def vocab_size(path: Path) -> int:
    return loading.vocab_size(load_config(path))


def cases(
    bases: Sequence[str],
    dtypes: Sequence[str] = DTYPES,
    prompt_lengths: Sequence[int] = PROMPT_LENGTHS,
    steps: int = DEFAULT_STEPS,
) -> list[ParityCase]:
    return [ParityCase(model_name(b, d), n, steps) for b in bases for d in dtypes for n in prompt_lengths]


def engine_run(model, ids: Sequence[int], steps: int, kv: KVQuantization | None = None) -> reference.Run:
    """Our side of a case: `steps + 1` greedy tokens, logits of every forward, final cache."""
    logits: list[mx.array] = []
    cache = model.make_cache()
    tokens = [
        t.token_id
        for t in generate(
            model,
            ids,
            stop=StopCriteria(max_tokens=steps + 1, ignore_eos=True),
            cache=cache,
            tap=lambda s: logits.append(s.logits.astype(mx.float32)),
            kv_quantization=kv,
        )
    ]
    mx.eval(logits)
    arrays = [[reference.to_numpy(a) for a in c.state] for c in cache]
    return reference.Run(tokens=tokens, logits=[reference.to_numpy(x[0]) for x in logits], cache=arrays)


def max_diff(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> tuple[float, int | None]:
    worst, first = 0.0, None
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return float("inf"), i if first is None else first
        if x.dtype.kind in "ui":
            d = 0.0 if np.array_equal(x, y) else float("inf")
        else:
            d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))) if x.size else 0.0
            if np.isnan(d) or not np.array_equal(np.isnan(x), np.isnan(y)):
                d = float("inf")
        if d > 0 and first is None:
            first = i
        worst = max(worst, d)
    return worst, first


def compare(ours: reference.Run, ref: reference.Run, steps: int) -> tuple[float, int | None, bool, float, int]:
    n = min(len(ours.logits), len(ref.logits))
    diff, first = max_diff(ours.logits, ref.logits)
    if len(ours.logits) != len(ref.logits):
        diff, first = float("inf"), n if first is None else first
    tokens_equal = ours.tokens[:steps] == ref.tokens[:steps]
    cache_diff = 0.0
    if len(ours.cache) != len(ref.cache):
        cache_diff = float("inf")
    for a, b in zip(ours.cache, ref.cache):
        if len(a) != len(b):
            cache_diff = float("inf")
            continue
        cache_diff = max(cache_diff, max_diff(a, b)[0])
    return diff, first, tokens_equal, cache_diff, n


def case_path(case: ParityCase) -> Path:
    return Path(case.model_path) if case.model_path else ensure_model(case.model, case.seed)


class _Models:
    """Loads each artifact once per process, for both sides."""

    def __init__(self):
        self._ours: dict[Path, object] = {}
        self._ref: dict[Path, object] = {}

    def get(self, path: Path):
        if path not in self._ours:
            self._ours[path] = load_model(path)[0]
            self._ref[path] = reference.load_model(path)
        return self._ours[path], self._ref[path]


_MODELS = _Models()


def run_case(case: ParityCase) -> ParityResult:
    start = time.perf_counter()
    path = case_path(case)
    ours_model, ref_model = _MODELS.get(path)
    ids = frozen_prompt_ids(case.prompt_len, vocab_size(path), case.seed)
    kvq = KVQuantization(case.kv_bits, case.kv_group_size, start=0) if case.kv_bits else None
    kv = dict(kv_bits=kvq.bits, kv_group_size=kvq.group_size, quantized_kv_start=kvq.start) if kvq else {}
    ref = reference.generate(ref_model, ids, case.steps, **kv)
    ours = engine_run(ours_model, ids, case.steps, kvq)
    diff, first, tokens_equal, cache_diff, n = compare(ours, ref, case.steps)
    return ParityResult(case, diff, first, tokens_equal, cache_diff, n, time.perf_counter() - start)
