"""Qwen3.5's multi-token-prediction head as the draft source.

The head maps a pair (target hidden state at position i, embedding of token
i + 1) to a prediction of token i + 2, through one decoder layer with its
own KV cache; the pair sits at cache position i. Pairs are exact when both
halves come from the target: every prompt position, and every position a
round kept. Drafting chains the head on its own output for the tokens after
the first; those speculative entries are trimmed after the round and the
kept positions go in again as exact pairs (the verifier hands their target
hidden states over in the round).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache
from engine.spec.source import Round


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
        self._last: Optional[mx.array] = None  # the head's output for the newest exact pair
        self._speculative = 0  # cache entries the last proposal added beyond the exact pairs

    sees_prompt_hidden = True  # the head runs on the target's hidden state of every prompt position

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.cache = [KVCache() for _ in self.head.layers]
        self.prompt = list(prompt_ids)
        self._hidden, self._next, self._last, self._speculative = [], [], None, 0

    def observe(self, hidden: mx.array, start: int) -> None:
        n = hidden.shape[1]
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
