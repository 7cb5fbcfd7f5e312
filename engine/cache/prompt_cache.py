"""The prompt (prefix) cache: finished requests' caches, reused by later prompts that share a prefix.

An entry holds single-row caches that contain exactly its `tokens`. A lookup
picks the entry that saves the most prompt tokens:

- trimmable entries (every layer can rewind: growing or quantized KV, a
  rotating window that has not wrapped) are cut back to the longest common
  prefix;
- the others (recurrent Gated DeltaNet state, a wrapped window) are reused
  at an exact stored boundary inside the common prefix: the whole entry, or
  one of its block snapshots (`CachedPrefix.snapshots`: the layers that
  cannot rewind, copied as prefill passed a multiple of the block size; the
  layers that can are the entry's own, cut back to the snapshot).

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


def snapshot(cache: list) -> list:
    """A block snapshot of single-row caches: a copy of each layer that cannot rewind, None for each that can
    (the stored entry's layer, cut back, stands in for it)."""
    return [None if c.is_trimmable() else copy.deepcopy(c) for c in cache]


@dataclass
class _Entry:
    ids: np.ndarray
    cache: list
    nbytes: int
    trimmable: bool
    snapshots: dict[int, list]  # tokens: the snapshot holding the first that many (non-trimmable entries)

    def boundaries(self, common: int, limit: int) -> int:
        """The most tokens of this entry a prompt sharing `common` tokens with it can start from (0: none)."""
        if self.trimmable:
            return min(common, limit)
        if common == self.ids.size <= limit:
            return self.ids.size
        return max((n for n in self.snapshots if n <= min(common, limit)), default=0)

    def caches(self, n: int) -> list:
        """Copies of caches holding the first n tokens (`boundaries`' n)."""
        if n == self.ids.size:
            return copy.deepcopy(self.cache)
        layers = self.snapshots.get(n) if not self.trimmable else None
        out = []
        for i, c in enumerate(self.cache):
            if layers is not None and layers[i] is not None:
                out.append(copy.deepcopy(layers[i]))
                continue
            c = copy.deepcopy(c)
            c.trim(self.ids.size - n)
            out.append(c)
        return out


@dataclass(frozen=True)
class PromptCacheStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    cached_tokens: int  # prompt tokens served from the cache, in all
    block_hits: int  # of the hits, those served from a block snapshot


class PromptCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest first
        self.bytes = 0
        self.hits = self.misses = self.cached_tokens = self.block_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = self.hits = self.misses = self.cached_tokens = self.block_hits = 0

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(len(self), self.bytes, self.max_bytes, self.hits, self.misses, self.cached_tokens,
                                self.block_hits)  # fmt: skip

    def lookup(self, prompt: Sequence[int]) -> Optional[CachedPrefix]:
        """A copy of the caches of the longest reusable prefix of `prompt`, or None."""
        ids = np.asarray(prompt, dtype=np.int64)
        limit = ids.size - 1  # the last prompt token is always computed
        best, best_n = None, 0
        for key, entry in self._entries.items():
            n = entry.boundaries(_common_prefix(entry.ids, ids), limit)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None
        entry = self._entries[best]
        self._entries.move_to_end(best)
        self.hits += 1
        self.block_hits += not entry.trimmable and best_n < entry.ids.size
        self.cached_tokens += best_n
        return CachedPrefix(tuple(prompt[:best_n]), entry.caches(best_n))

    def insert(self, prefix: CachedPrefix) -> bool:
        """Store a finished request's caches (with its block snapshots that the caches can complete); False when
        they alone exceed the budget."""
        key = tuple(prefix.tokens)
        trimmable = _trimmable(prefix.cache)
        snapshots = {} if trimmable else {
            n: layers for n, layers in prefix.snapshots
            if 0 < n < len(key) and all(s is not None or c.is_trimmable() for s, c in zip(layers, prefix.cache))
        }  # fmt: skip
        nbytes = cache_nbytes(prefix.cache) + sum(
            cache_nbytes([c for c in layers if c is not None]) for layers in snapshots.values())
        if not key or nbytes > self.max_bytes:
            return False
        self._remove(key)
        entry = _Entry(np.asarray(key, dtype=np.int64), prefix.cache, nbytes, trimmable, snapshots)
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
