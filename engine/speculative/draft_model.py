"""A separate, smaller model drafts autoregressively with its own caches (mlx-lm's scheme).

The draft's cache follows the target's accepted tokens with one wrinkle
(mlx-lm's re-feed rule): it has fed the pending token and all drafts but the
last, so after a round that accepted every draft, that last draft has not
been through it yet and goes in first next round. After a rejection it
keeps the pending token and the accepted drafts: a trim of
max(drafted - accepted - 1, 0), or, for recurrent layers, a rewind from the
trace of its draft steps (or a replay, see rollback.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.generate import prefill
from engine.speculative.rollback import Checkpoint, checkpoint, rewind, room
from engine.speculative.source import Round


def _greedy(model: nn.Module, cache: list, tokens: mx.array) -> mx.array:
    """One draft step on 1-D `tokens`: the argmax of the last position's logprobs (mlx-lm's draft step)."""
    logits = model(tokens[None], cache)[:, -1, :]
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


class DraftModelSource:
    kind = "draft"

    def __init__(self, model: nn.Module, prefill_step_size: int, trace: bool = True):
        self.model = model
        self.prefill_step_size = prefill_step_size
        self.trace = trace  # rewind recurrent layers from a trace (else by replay)
        self.cache: list = []
        self._lag: list[int] = []  # accepted tokens the draft has not fed yet
        self._fed: list[int] = []  # what this round fed, from `_point`
        self._point: Checkpoint | None = None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.cache = self.model.make_cache()
        self._lag = []
        prefill(self.model, self.cache, mx.array(list(prompt_ids)), self.prefill_step_size)

    def observe(self, hidden: mx.array, start: int) -> None:
        pass

    def propose(self, pending: int, limit: int) -> list[int]:
        inputs = self._lag + [pending]
        window = room(self.cache)
        if window is not None:
            limit = min(limit, window - len(inputs))  # never wrap a sliding window
        self._point, self._fed = None, []
        if limit <= 0:
            return []
        self._point = checkpoint(self.cache, self.trace)
        y = mx.array(inputs, mx.uint32)
        drafts = []
        for _ in range(limit):
            y = _greedy(self.model, self.cache, y)
            mx.async_eval(y)  # the next step's graph is built while this one runs
            drafts.append(y)
        ids = mx.concatenate(drafts).tolist()
        self._fed = inputs + ids[:-1]
        return ids

    def commit(self, result: Round) -> None:
        if self._point is None:  # nothing drafted or fed: the pending token waits for the next round
            self._lag.append(result.fed[0])
            return
        drafted = len(result.drafts)
        if result.accepted == drafted:
            self._lag = [result.drafts[-1]] if drafted else self._lag
            return
        keep = len(self._fed) - (drafted - 1) + result.accepted
        rewind(self.model, self.cache, self._point, self._fed, keep)
        self._lag = []
