"""Qwen3.5's multi-token-prediction head as the draft source.

The head maps a pair (target hidden state at position i, embedding of token
i + 1) to a prediction of token i + 2, through one decoder layer with its
own KV cache; the pair sits at cache position i. Pairs are exact when both
halves come from the target: every prompt position, and every position a
round kept. Drafting chains the head on its own output for the tokens after
the first; those speculative entries are trimmed after the round and the
kept positions go in again as exact pairs (the verifier hands their target
hidden states over in the round).

A prompt-cache entry keeps the head's state at its boundary (`boundary`):
after n prompt tokens, the pairs of positions 0 .. n - 2 (they need tokens up
to n - 1 only) and the target's hidden state at n - 1, whose pair waits for
the next prompt's token n. A request that starts the target from that entry
`resume`s the head from it instead of seeing the whole prompt again.

`BatchMTP` is the head for a group of spec rows in the continuous batch
(engine/batch/spec_rows.py): one batched KV cache per head layer holding
every row, fed each verify window's hidden states at the positions the row
kept (with the tokens that followed them) as exact pairs, drafting in
[B, 1] steps for all rows, its speculative entries trimmed after the round.
A row joins with its prompt's pairs: the batched prefill keeps an MTP spec
row's target hidden states over every prompt chunk and the token-0 forward
(engine/batch/runner.py), as the serial head sees them; after a prompt-cache
hit only the uncached suffix's pairs go in (the head has no state for the
cached part). A row given none starts with no pairs and drafts from its
first window on.
Its KV counts in the batch's budget (`BatchMTP.layout`: the head's layers
over the prompt and max_tokens, as the target's).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from engine.batch.kv_budget import KVLayout, LayerKV
from engine.batch.kv_layout import activation_itemsize
from engine.cache import BatchKVCache, KVCache, cache_arrays, cache_nbytes, kept_rows, with_rows
from engine.cache.kv import owned_copies
from engine.speculative.source import Round


@dataclass(frozen=True)
class MTPState:
    """The head's state after `tokens` prompt tokens: its caches over the pairs of positions 0 .. tokens - 2 and
    the target's final hidden state at position tokens - 1 ([1, 1, H])."""

    tokens: int
    cache: list
    hidden: mx.array
    kind: str = "mtp"

    @property
    def nbytes(self) -> int:
        return cache_nbytes(self.cache) + self.hidden.nbytes


class MTPSource:
    kind = "mtp"

    def __init__(self, model: nn.Module):
        if not getattr(model, "has_mtp", False):
            raise ValueError("this model carries no MTP head (Qwen3.5 checkpoints with mtp.* weights do)")
        text = model.language_model
        self.head = text.mtp
        self.embed = text.model.embed_tokens
        self.logits = model.logits
        self.itemsize = activation_itemsize(model)  # bytes per element of the head's KV
        self.cache: list = []
        self.prompt: list[int] = []
        self._hidden: list[mx.array] = []  # queued exact pairs: hidden rows [1, n, H] ...
        self._next: list[int] = []  # ... and the tokens that followed them
        self._last: mx.array | None = None  # the head's output for the newest exact pair
        self._speculative = 0  # cache entries the last proposal added beyond the exact pairs
        self._tail: mx.array | None = None  # the target's hidden state at the newest prompt position seen

    sees_prompt_hidden = True  # the head runs on the target's hidden state of every prompt position

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.cache = [KVCache() for _ in self.head.layers]
        self.prompt = list(prompt_ids)
        self._hidden, self._next, self._last, self._speculative, self._tail = [], [], None, 0, None

    def resume(self, state: MTPState) -> None:
        """Start from a prompt-cache entry's state (after `begin`): the target holds `state.tokens` prompt tokens
        and prefills from there."""
        if not 0 < state.tokens < len(self.prompt):
            raise ValueError(f"an MTP state after {state.tokens} tokens cannot start a {len(self.prompt)}-token prompt")
        self.cache = state.cache
        self._hidden, self._next = [state.hidden], [self.prompt[state.tokens]]
        self._tail = state.hidden

    def boundary(self) -> MTPState | None:
        """A copy of the state after the prompt tokens the target holds once its prefill is done (all but the last
        prompt token), for the prompt cache; None for a one-token prompt."""
        n = len(self.prompt) - 1
        if n < 1:
            return None
        self._flush()  # the pair of position n - 1 (whose token is the prompt's last) goes in, then comes out
        cache = copy.deepcopy(self.cache)
        for c in cache:
            c.trim(1)
        hidden = owned_copies([self._tail])[0]  # not a view that keeps the last chunk's hidden states alive
        mx.eval([c.state for c in cache], hidden)
        return MTPState(n, cache, hidden)

    def observe(self, hidden: mx.array, start: int) -> None:
        n = hidden.shape[1]
        self._tail = hidden[:, -1:, :]
        self._hidden.append(hidden)
        self._next.extend(self.prompt[start + 1 : start + n + 1])
        self._flush()
        mx.eval([c.state for c in self.cache])

    def _flush(self) -> None:
        if not self._next:
            return
        hidden = mx.concatenate(self._hidden, axis=1) if len(self._hidden) > 1 else self._hidden[0]
        out = self.head(hidden, self.embed(mx.array(self._next)[None]), self.cache)
        self._last = out[:, -1:, :]
        self._hidden, self._next = [], []

    def batched(self) -> BatchMTP:
        """This head for a group of rows at once (the spec rows of a continuous batch)."""
        kv = tuple(
            LayerKV("kv", bytes_per_token=layer.self_attn.kv_channels * self.itemsize) for layer in self.head.layers
        )
        return BatchMTP(self.head, self.embed, self.logits, KVLayout(kv))

    def _draft(self, out: mx.array) -> mx.array:
        logits = self.logits(out)[:, -1, :]
        return mx.argmax(logits, axis=-1)

    def propose(self, pending: int, limit: int) -> list[int]:
        self._speculative = 0
        if limit <= 0:
            return []  # the exact pairs wait in the queue: one forward for all of them when drafting resumes
        self._flush()
        if self._last is None:  # a one-token prompt has no pair yet
            return []
        y = self._draft(self._last)
        drafts = [y]
        out = self._last
        for _ in range(limit - 1):
            out = self.head(out, self.embed(y[None]), self.cache)
            self._speculative += 1
            y = self._draft(out)
            mx.async_eval(y)
            drafts.append(y)
        return mx.concatenate(drafts).tolist()

    def commit(self, result: Round) -> None:
        for c in self.cache:
            c.trim(self._speculative)
        self._speculative = 0
        kept = result.accepted + 1
        self._hidden.append(result.hidden[:, :kept, :])
        self._next.extend(list(result.drafts[: result.accepted]) + [result.next_token])


@dataclass
class BatchMTP:
    """The MTP head for every spec row of a batch: merged head caches, [B, 1] draft steps, per-row exact pairs."""

    head: nn.Module
    embed: nn.Module
    logits: object  # the target's lm head: hidden states to logits
    layout: KVLayout | None = None  # the head's own KV per row, for the batch's budget (over the prompt's pairs too)
    cache: list | None = None  # one BatchKVCache per head layer
    queued: list[tuple[list[mx.array], list[int]]] = field(default_factory=list)  # per row: exact pairs to feed
    last: list[mx.array | None] = field(default_factory=list)  # per row: the head's output for its newest pair
    steps: int = 0  # drafts the last `propose` made per row (0: it fed nothing)
    sees_hidden = True  # `commit` takes the verify window's hidden states and each row's next token

    def join(
        self, prompts: Sequence[Sequence[int]], first: Sequence[int] = (), hidden: Sequence[mx.array | None] = ()
    ) -> None:
        """New last rows. A row given the target's final hidden states over its prompt (hidden[b], [1, n, H]) and its
        token 0 (first[b]) starts with its prompt's pairs, as the serial head does; a row without starts with no
        pairs, and its first window's hidden states are its first. Hidden states over the prompt's last n positions
        only (a prompt-cache hit: the target never computed the cached part's) give those positions' pairs."""
        n = len(prompts)
        self.cache = with_rows(self.cache, [BatchKVCache([0] * n) for _ in self.head.layers])
        for b, prompt in enumerate(prompts):
            h = hidden[b] if b < len(hidden) else None
            self.queued.append(([h], [*prompt[1:], first[b]][-h.shape[1] :]) if h is not None else ([], []))
        self.last += [None] * n

    def propose(self, pending: Sequence[int], limits: Sequence[int]) -> list[list[int]]:
        """Row b's first limits[b] drafts after its pending token (none before the row has a pair); every row
        drafts max(limits)."""
        self.steps = max(limits, default=0)
        if self.steps == 0:
            return [[] for _ in limits]  # the pairs wait: one forward for all of them when drafting resumes
        self._flush()
        ready = [x is not None for x in self.last]
        if not any(ready):
            self.steps = 0
            return [[] for _ in limits]
        zero = mx.zeros_like(next(x for x in self.last if x is not None))
        out = mx.concatenate([x if x is not None else zero for x in self.last])  # [B, 1, H]
        y = mx.argmax(self.logits(out)[:, -1, :], axis=-1)
        drafts = [y]
        for _ in range(self.steps - 1):
            out = self.head(out, self.embed(y[:, None]), self.cache)
            y = mx.argmax(self.logits(out)[:, -1, :], axis=-1)
            mx.async_eval(y)
            drafts.append(y)
        ids = mx.stack(drafts, axis=1).tolist()
        return [row[:n] if r else [] for row, n, r in zip(ids, limits, ready)]

    def _flush(self) -> None:
        """Every row's queued pairs through the head in one right-padded forward; the padding is trimmed."""
        lengths = [len(tokens) for _, tokens in self.queued]
        width = max(lengths, default=0)
        if width == 0:
            return
        rows = [mx.concatenate(h, axis=1) if h else None for h, _ in self.queued]
        ref = next(h for h in rows if h is not None)
        hidden = mx.concatenate(
            [
                mx.pad(h, [(0, 0), (0, width - n), (0, 0)])
                if h is not None
                else mx.zeros((1, width, ref.shape[2]), ref.dtype)
                for h, n in zip(rows, lengths)
            ]
        )
        tokens = mx.array([t + [0] * (width - n) for (_, t), n in zip(self.queued, lengths)])
        out = self.head(hidden, self.embed(tokens), self.cache)
        for c in self.cache:
            c.trim_rows([width - n for n in lengths])
        self.last = [out[b : b + 1, n - 1 : n] if n else x for b, (n, x) in enumerate(zip(lengths, self.last))]
        self.queued = [([], []) for _ in self.queued]
        mx.eval(cache_arrays(self.cache), [x for x in self.last if x is not None])

    def commit(self, fed: Sequence[Sequence[int]], accepted: Sequence[int], hidden: mx.array, pending: Sequence[int]):
        """The target fed row b `fed[b]`, kept `fed[b][:accepted[b] + 1]` and then emitted `pending[b]`; `hidden`
        [B, W, H] is its final hidden state over the window. A round that drafted nothing may leave out the last
        rows (rows that joined after its window was launched)."""
        if self.steps > 1:  # the chained drafts' entries: every row added steps - 1
            for c in self.cache:
                c.trim_rows([self.steps - 1] * c.batch_size)
        self.steps = 0
        for b, (f, a, p) in enumerate(zip(fed, accepted, pending)):
            h, t = self.queued[b]
            h.append(hidden[b : b + 1, : a + 1])
            t.extend([*f[1 : a + 1], p])

    def filter(self, keep: Sequence[int]) -> None:
        """Keep these rows (in this order); none: the next joiners start a fresh group."""
        self.queued = [self.queued[i] for i in keep]
        self.last = [self.last[i] for i in keep]
        self.cache = kept_rows(self.cache, keep)

    def reset(self) -> None:
        self.cache, self.queued, self.last, self.steps = None, [], [], 0
