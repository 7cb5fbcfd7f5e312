"""The same-B parity gate: our continuous batcher against mlx-lm's BatchGenerator.

Both sides get the same prompts arriving at the same loop iterations; every
row's float32 logits at every forward it takes part in must be identical, and
so must the generated ids. Cases (each for every family):

    simultaneous   B = 2, 3, 4, 8 requests at once, unequal prompt lengths
    late join      a request arrives after the others emitted k tokens
    retire         one row finishes while the others continue
    join after     a request joins after a row retired
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.loading import load_model
from engine.request import GenerationRequest, StopCriteria
from engine.sinks import CollectingSink
from harness.gates.parity import case_path, max_diff, vocab_size
from oracles import batch_reference
from oracles.batch_reference import Arrival, BatchRun
from oracles.cases import frozen_prompt_ids
from oracles.reference import load_model as load_reference
from oracles.reference import to_numpy

# prompt lengths used by the cases: short, past the gemma window (64), a 1-token prompt
LENGTHS = (37, 300, 5, 120, 1, 64, 250, 17)


@dataclass(frozen=True)
class BatchCase:
    model: str
    name: str
    arrivals: tuple[tuple[int, int, int], ...]  # (iteration, prompt length, max tokens)
    max_rows: int = 8
    prefill_batch: int = 8  # prompts prefilled together (BatchGenerator's prefill_batch_size)
    seed: int = 0
    model_path: str | None = None

    @property
    def batch(self) -> int:
        return len(self.arrivals)

    @property
    def label(self) -> str:
        return f"{self.model} {self.name} P={self.prefill_batch}"


def scenario_cases(
    model: str, batches: Sequence[int] = (2, 3, 4, 8), prefill_batches: Sequence[int] = (8, 1)
) -> list[BatchCase]:
    """Every scenario with prompts prefilled in groups (P=8, mlx_lm.server's default) and alone (P=1)."""
    shapes = [(f"B={b} simultaneous", tuple((0, LENGTHS[i], 12 + 2 * i) for i in range(b)), b) for b in batches]
    if max(batches) >= 3:
        shapes += [
            ("late join after 6 tokens", ((0, 37, 20), (0, 300, 20), (9, 120, 12)), 8),
            ("row retires, others continue", ((0, 37, 4), (0, 120, 24), (0, 5, 24)), 8),
            ("join after a retirement", ((0, 300, 5), (0, 17, 30), (12, 64, 10)), 2),
        ]
    return [BatchCase(model, name, arrivals, rows, p) for p in prefill_batches for name, arrivals, rows in shapes]


@dataclass(frozen=True)
class BatchResult:
    case: BatchCase
    max_abs_diff: float
    first_diff: str | None  # "row r forward f"
    tokens_equal: bool
    forwards: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.max_abs_diff == 0.0 and self.tokens_equal

    def as_record(self) -> dict:
        return {**asdict(self.case), **{k: v for k, v in asdict(self).items() if k != "case"}, "passed": self.passed}


def arrivals_for(case: BatchCase, vocab: int) -> list[Arrival]:
    return [
        Arrival(at, tuple(frozen_prompt_ids(n, vocab, seed=case.seed + 101 * i)), m)
        for i, (at, n, m) in enumerate(case.arrivals)
    ]


def engine_run(model, arrivals: Sequence[Arrival], max_rows: int, prefill_batch: int = 8) -> BatchRun:
    logits: dict[str, list[mx.array]] = {str(i): [] for i in range(len(arrivals))}
    batcher = ContinuousBatcher(
        model,
        SchedulerConfig(max_rows=max_rows, prefill_batch=prefill_batch),
        tap=lambda rid, row: logits[rid].append(row.astype(mx.float32)),
    )
    sinks = [CollectingSink() for _ in arrivals]
    it = 0
    while it == 0 or batcher.has_work or any(a.at >= it for a in arrivals):
        for i, a in enumerate(arrivals):
            if a.at == it:
                req = GenerationRequest(
                    str(i), a.prompt_ids, stop=StopCriteria(max_tokens=a.max_tokens, ignore_eos=True)
                )
                batcher.submit(req, sinks[i])
        batcher.step()
        it += 1
    mx.eval(list(logits.values()))
    rows = [[to_numpy(x[0]) for x in logits[str(i)]] for i in range(len(arrivals))]
    return BatchRun([s.token_ids for s in sinks], rows, it)


_MODELS: dict[Path, tuple] = {}


def run_batch_case(case: BatchCase) -> BatchResult:
    start = time.perf_counter()
    path = case_path(case)
    if path not in _MODELS:
        _MODELS[path] = (load_model(path)[0], load_reference(path))
    ours_model, ref_model = _MODELS[path]
    arrivals = arrivals_for(case, vocab_size(path))
    ref = batch_reference.run(ref_model, arrivals, case.max_rows, prefill_batch_size=case.prefill_batch)
    ours = engine_run(ours_model, arrivals, case.max_rows, case.prefill_batch)
    worst, first, forwards = 0.0, None, 0
    for r, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        d, f = max_diff(a, b)
        if len(a) != len(b):
            d, f = float("inf"), min(len(a), len(b)) if f is None else f
        if d > 0 and first is None:
            first = f"row {r} forward {f}"
        worst = max(worst, d)
        forwards += min(len(a), len(b))
    return BatchResult(case, worst, first, ours.tokens == ref.tokens, forwards, time.perf_counter() - start)
