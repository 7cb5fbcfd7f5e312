"""The same-B oracle: mlx-lm's BatchGenerator driven with a given arrival schedule.

BatchGenerator admits up to prefill_batch_size prompts into its prompt batch,
prefills one right-padded chunk of each per `next()` between decode steps,
samples a prompt's first token from an L=1 forward on the prompt batch's
caches once its prompt is through, then extends the running batch: the
schedule our continuous batcher follows at the same prefill batch size.
Each row's raw logits at every forward are recorded by a pass-through logits
processor (processors see the logits before sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from oracles.reference import to_numpy


@dataclass(frozen=True)
class Arrival:
    """A request that enters before loop iteration `at` (0 = before the first)."""

    at: int
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class BatchRun:
    tokens: list[list[int]]  # per arrival, generated ids
    logits: list[list[np.ndarray]]  # per arrival, float32 logits of every forward it was in
    iterations: int


def run(
    model, arrivals: Sequence[Arrival], max_rows: int, prefill_batch_size: int = 8, prefill_step_size: int = 2048
) -> BatchRun:
    from mlx_lm.generate import BatchGenerator

    logits: list[list[mx.array]] = [[] for _ in arrivals]
    tokens: list[list[int]] = [[] for _ in arrivals]

    def recorder(i: int):
        def record(_context, row_logits):
            logits[i].append(row_logits.astype(mx.float32))
            return row_logits

        return record

    gen = BatchGenerator(
        model,
        prefill_batch_size=prefill_batch_size,
        completion_batch_size=max_rows,
        prefill_step_size=prefill_step_size,
    )
    index_of_uid: dict[int, int] = {}
    finished = 0
    it = 0
    try:
        while finished < len(arrivals):
            for i, a in enumerate(arrivals):
                if a.at == it:
                    (uid,) = gen.insert(
                        [list(a.prompt_ids)], max_tokens=[a.max_tokens], logits_processors=[[recorder(i)]]
                    )
                    index_of_uid[uid] = i
            _, responses = gen.next()
            for r in responses:
                tokens[index_of_uid[r.uid]].append(r.token)
                finished += r.finish_reason is not None
            it += 1
            if it > 100_000:
                raise RuntimeError("BatchGenerator did not finish")
    finally:
        gen.close()
    mx.eval(logits)
    return BatchRun(tokens, [[to_numpy(x[0]) for x in row] for row in logits], it)
