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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache, cache_nbytes
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
