"""Prompt lookup: draft the tokens that followed the last time the context's tail appeared.

For n from `max_n` down to `min_n`, look for the most recent earlier
occurrence of the last n tokens (prompt and output together); the tokens
that followed it are the draft. Occurrences are indexed as the context
grows, so a lookup costs a dictionary probe per n, not a scan.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.speculative.source import Round


class NgramSource:
    kind = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got min {min_n}, max {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.history: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence before the tail
        self._indexed = 0  # n-grams ending before this position are in _ends

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.history = list(prompt_ids)
        self._ends.clear()
        self._indexed = 0

    def observe(self, hidden: mx.array, start: int) -> None:
        pass

    def _index(self) -> None:
        # Index every n-gram that ends strictly before the current tail, so a
        # lookup of the tail finds an earlier occurrence with tokens after it.
        h = self.history
        for end in range(max(self._indexed, self.min_n), len(h)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(h[end - n : end])] = end
        self._indexed = max(self._indexed, len(h))

    def propose(self, pending: int, limit: int) -> list[int]:
        # `pending` is already the last entry of history (begin / commit put it there).
        if limit <= 0:
            return []
        self._index()
        h = self.history
        for n in range(min(self.max_n, len(h) - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(h[-n:]))
            if end is not None:
                return h[end : end + limit]
        return []

    def commit(self, result: Round) -> None:
        self.history.extend(result.drafts[: result.accepted])
        self.history.append(result.next_token)
