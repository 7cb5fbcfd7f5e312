"""The prompt (prefix) cache: finished requests' caches, reused by later prompts that share a prefix.

An entry holds single-row caches that contain exactly its `tokens`. A lookup
picks the entry that saves the most prompt tokens:

- trimmable entries (every layer can rewind: growing or quantized KV, a
  rotating window that has not wrapped) are cut back to the longest common
  prefix;
- the others (recurrent Gated DeltaNet state, a wrapped window) are reused
  only when the whole entry is a prefix of the prompt: an exact stored
  boundary.

At least the last prompt token is always left to compute, since its logits
give the first generated token. The hit is a deep copy, so the entry stays
intact while the request extends its copy. Entries leave least recently used
first when the byte budget is exceeded.

An entry counts the nbytes of the arrays it holds, so the budget bounds real
memory only if those arrays are not views of something larger: rows that
come from a batch are copies that own their bytes (the batch caches'
`extract`), and callers do not keep the inserted caches alive elsewhere.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from engine.cache import cache_nbytes
from engine.request import CachedPrefix


def _trimmable(cache: list) -> bool:
    return all(c.is_trimmable() for c in cache)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class _Entry:
    ids: np.ndarray
    cache: list
    nbytes: int
    trimmable: bool


@dataclass(frozen=True)
class PromptCacheStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    cached_tokens: int  # prompt tokens served from the cache, in all


class PromptCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest first
        self.bytes = 0
        self.hits = self.misses = self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = self.hits = self.misses = self.cached_tokens = 0

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(len(self), self.bytes, self.max_bytes, self.hits, self.misses, self.cached_tokens)

    def lookup(self, prompt: Sequence[int]) -> Optional[CachedPrefix]:
        """A copy of the caches of the longest reusable prefix of `prompt`, or None."""
        ids = np.asarray(prompt, dtype=np.int64)
        limit = ids.size - 1  # the last prompt token is always computed
        best, best_n = None, 0
        for key, entry in self._entries.items():
            common = _common_prefix(entry.ids, ids)
            if entry.trimmable:
                n = min(common, limit)
            else:
                n = entry.ids.size if common == entry.ids.size <= limit else 0
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None
        entry = self._entries[best]
        self._entries.move_to_end(best)
        cache = copy.deepcopy(entry.cache)
        if entry.ids.size > best_n:
            for c in cache:
                c.trim(entry.ids.size - best_n)
        self.hits += 1
        self.cached_tokens += best_n
        return CachedPrefix(tuple(prompt[:best_n]), cache)

    def insert(self, prefix: CachedPrefix) -> bool:
        """Store a finished request's caches; False when they alone exceed the budget."""
        key = tuple(prefix.tokens)
        nbytes = cache_nbytes(prefix.cache)
        if not key or nbytes > self.max_bytes:
            return False
        self._remove(key)
        entry = _Entry(np.asarray(key, dtype=np.int64), prefix.cache, nbytes, _trimmable(prefix.cache))
        if entry.trimmable:  # a trimmable entry serves every prefix of itself: drop those
            for other in [k for k, e in self._entries.items() if len(k) < len(key) and key[: len(k)] == k]:
                self._remove(other)
        self._entries[key] = entry
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
