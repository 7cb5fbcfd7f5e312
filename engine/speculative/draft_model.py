"""A separate, smaller model drafts autoregressively with its own caches (mlx-lm's scheme).

The draft's cache follows the target's accepted tokens with one wrinkle
(mlx-lm's re-feed rule): it has fed the pending token and all drafts but the
last, so after a round that accepted every draft, that last draft has not
been through it yet and goes in first next round. After a rejection it
keeps the pending token and the accepted drafts: a trim of
max(drafted - accepted - 1, 0), or, for recurrent layers, a rewind from the
trace of its draft steps (or a replay, see rollback.py).

`BatchDraft` is the same draft for a group of spec rows in the continuous
batch (engine/batch/spec_rows.py): one batched cache per layer holding
every row (each joiner prefilled alone, then appended as the batcher
appends target rows), one [B, 1] greedy step per draft for all rows. Its
re-feed rule keeps a row's cache one token behind: it ends before
[lag, pending], a drafting round feeds both, then the drafts, and rolls each
row back to what the target kept (`BatchKVCache.trim_rows`,
`RecurrentCache.keep_traced_rows`), the next lag being the last kept token.
A round that drafts nothing feeds the draft nothing either (plain windows
cost what plain decoding costs): the rows fall further behind, and the next
drafting round first feeds each row's backlog but its last token in one
right-padded forward, so every row again feeds [lag, pending].
Its caches count in the batch's KV budget: a spec row's projected bytes add
the draft's own (`BatchDraft.layout`) over the same tokens as the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from engine.batch.kv_budget import KVLayout
from engine.batch.kv_layout import kv_layout
from engine.cache import BatchKVCache, KVCache, RecurrentCache, cache_arrays, kept_rows, with_rows
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

    def batched(self) -> BatchDraft:
        """This draft for a group of rows at once (the spec rows of a continuous batch)."""
        return BatchDraft(self.model, self.prefill_step_size)

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


def _merged(layer: Sequence) -> BatchKVCache | RecurrentCache:
    """One layer of the group's draft cache from its rows' single-row caches."""
    if isinstance(layer[0], RecurrentCache):
        return RecurrentCache.merge(layer)
    if type(layer[0]) is not KVCache:
        raise ValueError(f"a batched draft cannot roll back rows of a {type(layer[0]).__name__}")
    return BatchKVCache.merge(layer)


@dataclass
class BatchDraft:
    """The draft model for every spec row of a batch: merged caches, [B, 1] greedy steps, per-row rollback."""

    model: nn.Module
    prefill_step_size: int
    cache: list | None = None
    behind: list[list[int]] = field(default_factory=list)  # per row: the tokens before its pending one not fed yet
    steps: int = 0  # drafts the last `propose` made per row (0: it fed nothing)
    layout: KVLayout = field(init=False, repr=False)  # the draft's own KV per row, for the batch's budget

    def __post_init__(self):
        self.layout = kv_layout(self.model)

    def join(self, prompts: Sequence[Sequence[int]]) -> None:
        """New last rows: each prompt but its last token through the draft alone, then into the group."""
        singles = []
        for prompt in prompts:
            cache = self.model.make_cache()
            prefill(self.model, cache, mx.array(list(prompt)), self.prefill_step_size)
            singles.append(cache)
        self.cache = with_rows(self.cache, [_merged(layer) for layer in zip(*singles)])
        self.behind += [[prompt[-1]] for prompt in prompts]

    def propose(self, pending: Sequence[int], limits: Sequence[int]) -> list[list[int]]:
        """Row b's first limits[b] greedy drafts after its pending token; all rows draft max(limits)."""
        self.steps = max(limits, default=0)
        if self.steps == 0:
            return [[] for _ in limits]
        self._catch_up()
        for c in self.cache:
            if isinstance(c, RecurrentCache):
                c.start_trace()
        y = mx.array([[b[-1], p] for b, p in zip(self.behind, pending)], mx.uint32)
        drafts = []
        for _ in range(self.steps):
            logits = self.model.logits(self.model.hidden(y, self.cache)[:, -1:, :])[:, 0, :]
            y = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)[:, None]
            mx.async_eval(y)  # the next step's graph is built while this one runs
            drafts.append(y)
        ids = mx.concatenate(drafts, axis=1).tolist()
        return [row[:n] for row, n in zip(ids, limits)]

    def _catch_up(self) -> None:
        """Feed every row's backlog but its last token (one right-padded forward), so each row is one behind."""
        lengths = [len(b) - 1 for b in self.behind]
        width = max(lengths)
        if width == 0:
            return
        x = mx.array([b[:-1] + [0] * (width - n) for b, n in zip(self.behind, lengths)], mx.uint32)
        padding = [width - n for n in lengths]
        for c in self.cache:
            if isinstance(c, RecurrentCache):
                c.prepare(lengths, padding)  # the padding leaves the state and the conv tail alone
        self.model.hidden(x, self.cache)
        for c in self.cache:
            if isinstance(c, RecurrentCache):
                c.finalize()
            else:
                c.trim_rows(padding)
        self.behind = [b[-1:] for b in self.behind]

    def commit(self, fed: Sequence[Sequence[int]], accepted: Sequence[int]) -> None:
        """The target fed row b `fed[b]` (its pending token and drafts) and kept `fed[b][:accepted[b] + 1]`. A round
        that drafted nothing may leave out the last rows (rows that joined after its window was launched)."""
        if self.steps == 0:  # nothing fed: each row falls one more token behind
            for b, f in zip(self.behind, fed):
                b.append(f[0])
            return
        # fed [lag, pending, drafts 1 .. steps - 1]: keep the lag, the pending token and accepted - 1 drafts
        for c in self.cache:
            if isinstance(c, RecurrentCache):
                c.keep_traced_rows([a + 1 for a in accepted])
            else:
                c.trim_rows([self.steps - a for a in accepted])
        self.behind = [[f[a]] for f, a in zip(fed, accepted)]
        self.steps = 0
        mx.async_eval(cache_arrays(self.cache))

    def filter(self, keep: Sequence[int]) -> None:
        """Keep these rows (in this order); none: the next joiners start a fresh group."""
        self.behind = [self.behind[i] for i in keep]
        self.cache = kept_rows(self.cache, keep)

    def reset(self) -> None:
        self.cache, self.behind, self.steps = None, [], 0
