"""The prompt (prefix) cache: finished requests' caches, reused by later prompts that share a prefix.

An entry holds single-row caches that contain exactly its `tokens`. A lookup
picks the entry that saves the most prompt tokens:

- trimmable entries (every layer can rewind: growing or quantized KV, a
  rotating window that has not wrapped) are cut back to the longest common
  prefix;
- the others (recurrent Gated DeltaNet state, a wrapped window) are reused
  at an exact stored boundary inside the common prefix: the whole entry, or
  one of its block snapshots (`CachedPrefix.snapshots`: the layers that
  cannot rewind as they were after a multiple of the block size, kept from
  inside the prefill's forwards where those layers can (`keep_at`,
  `snapshot_at`); the layers that can rewind are the entry's own, cut back
  to the snapshot).

At least the last prompt token is always left to compute, since its logits
give the first generated token. The hit is a deep copy, so the entry stays
intact while the request extends its copy. Entries leave least recently used
first when the byte budget is exceeded.

An entry may also hold a draft source's state at its end (`CachedPrefix.draft`,
the speculative lane's MTP head): a lookup that asks for that kind of state
(`lookup(prompt, draft=...)`) takes only such entries, whole, and hands a
copy of the state with the caches. The disk tier does not keep it.

With a disk tier (`prompt_disk.DiskTier`), entries the budget evicts, and
all of them at `flush` (shutdown), go to disk; a lookup that finds a longer
start there than in RAM loads that entry back into RAM.

With quantized KV (`full_chunk`), a prompt's first prefill chunk attends to
full-precision keys and everything after it to quantized ones (mlx-lm's
kv_bits), so a start is exact only past that chunk and only from entries
whose first chunk was the same: the cache then keeps only entries made with
a first chunk of `full_chunk` tokens and serves starts of at least that many.

An entry counts the nbytes of the arrays it holds, so the budget bounds real
memory only if those arrays are not views of something larger: rows that
come from a batch are copies that own their bytes (the batch caches'
`extract`), and callers do not keep the inserted caches alive elsewhere.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.cache import BatchKVCache, KVCache, QuantizedKVCache, RecurrentCache, cache_nbytes
from engine.cache.prefix_index import PrefixIndex, common_prefix
from engine.cache.prompt_disk import DiskTier
from engine.request import CachedPrefix


def _trimmable(cache: list) -> bool:
    return all(c.is_trimmable() for c in cache)


def snapshot(cache: list, copied: bool = False) -> list:
    """A block snapshot of single-row caches: a copy of each layer that cannot rewind, None for each that can
    (the stored entry's layer, cut back, stands in for it) and for each left out (None). `copied`: the layers
    are copies already (extracted from a batch), kept as they are."""
    return [None if c is None or c.is_trimmable() else c if copied else copy.deepcopy(c) for c in cache]


def markable(cache: list) -> bool:
    """Whether a forward can keep block snapshots from inside itself (`keep_at`): each layer is recurrent (it
    records its state where asked) or growing KV (the stored entry's, cut back, stands in for it)."""
    return all(isinstance(c, (RecurrentCache, KVCache, QuantizedKVCache, BatchKVCache)) for c in cache)


def keep_at(cache: list, at: Sequence[Sequence[int]]) -> None:
    """The next forward keeps each row b's recurrent layers after each count of its tokens in at[b]."""
    for c in cache:
        if isinstance(c, RecurrentCache):
            c.keep_at(at)


def snapshot_at(cache: list, row: int, n: int, layers: Collection[int] | None = None) -> list:
    """After the forward `keep_at` asked for, a block snapshot of row `row` after the first `n` tokens of that
    forward, in `snapshot`'s form (copies; `layers`: only these, None elsewhere)."""
    return [
        c.kept(row, n) if isinstance(c, RecurrentCache) and (layers is None or i in layers) else None
        for i, c in enumerate(cache)
    ]


def unmark(cache: list) -> None:
    for c in cache:
        if isinstance(c, RecurrentCache):
            c.unmark()


def _start(ids: np.ndarray, trimmable: bool, snapshot_at, common: int, limit: int) -> int:
    """The most tokens of an entry holding `ids` a prompt sharing `common` tokens with it can start from."""
    if trimmable:
        return min(common, limit)
    if common == ids.size <= limit:
        return ids.size
    return max((n for n in snapshot_at if n <= min(common, limit)), default=0)


@dataclass
class _Entry:
    ids: np.ndarray
    cache: list
    nbytes: int
    trimmable: bool
    snapshots: dict[int, list]  # tokens: the snapshot holding the first that many (non-trimmable entries)
    draft: Any = None  # a draft source's state after all of `ids` (CachedPrefix.draft)
    used: int = 0  # when it was stored or last hit: of two entries that save as much, the older one serves

    def caches(self, n: int) -> list:
        """Copies of caches holding the first n tokens (n: a start `_start` allows)."""
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
    disk_hits: int = 0  # of the hits, those loaded from the disk tier
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_error: str | None = None  # why the disk tier turned itself off


class PromptCache:
    def __init__(self, max_bytes: int, disk: DiskTier | None = None, full_chunk: int | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if full_chunk is not None and full_chunk < 1:
            raise ValueError(f"full_chunk must be >= 1, got {full_chunk}")
        self.max_bytes = max_bytes
        self.disk = disk
        self.full_chunk = full_chunk  # quantized KV: the first chunk every entry and start must share
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest first
        self._index = PrefixIndex()  # the same keys, walked from the longest common prefix with a prompt
        self._clock = itertools.count()
        self.bytes = 0
        self.hits = self.misses = self.cached_tokens = self.block_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.bytes = self.hits = self.misses = self.cached_tokens = self.block_hits = 0

    def stats(self) -> PromptCacheStats:
        disk = self.disk
        on_disk = (disk.hits, len(disk.entries), disk.bytes, disk.error) if disk else (0, 0, 0, None)
        return PromptCacheStats(
            len(self), self.bytes, self.max_bytes, self.hits, self.misses, self.cached_tokens, self.block_hits, *on_disk
        )

    def lookup(self, prompt: Sequence[int], draft: str | None = None) -> CachedPrefix | None:
        """A copy of the caches of the longest reusable prefix of `prompt`, or None. `draft`: only whole entries
        that hold a draft source's state of that kind, handed over (a copy) with the caches."""
        ids = np.asarray(prompt, dtype=np.int64)
        limit = ids.size - 1  # the last prompt token is always computed
        best, best_n, best_used, floor = None, 0, 0, self._min_start
        for (key, entry), common in self._index.nearest(tuple(ids.tolist()), ids):
            if common < best_n or common < floor:  # no entry further out can save as much
                break
            if draft is None:
                n = _start(entry.ids, entry.trimmable, entry.snapshots, common, limit)
            else:
                whole = entry.ids.size <= limit and common == entry.ids.size
                n = entry.ids.size if whole and getattr(entry.draft, "kind", None) == draft else 0
            if n >= floor and (n > best_n or n == best_n and entry.used < best_used):
                best, best_n, best_used = key, n, entry.used
        loaded = self._from_disk(ids, limit, best_n) if draft is None else None
        if loaded is not None:
            best, best_n = loaded
        if best is None:
            self.misses += 1
            return None
        entry = self._entries[best]
        self._entries.move_to_end(best)
        entry.used = next(self._clock)
        self.hits += 1
        self.block_hits += not entry.trimmable and best_n < entry.ids.size
        self.cached_tokens += best_n
        state = copy.deepcopy(entry.draft) if draft is not None else None
        return CachedPrefix(tuple(prompt[:best_n]), entry.caches(best_n), draft=state, full_chunk=self.full_chunk)

    @property
    def _min_start(self) -> int:
        return self.full_chunk or 1

    def _from_disk(self, ids: np.ndarray, limit: int, ram_best: int) -> tuple[tuple[int, ...], int] | None:
        """Where the disk tier holds a longer start than RAM: that entry loaded into RAM, (its key, the start)."""
        if self.disk is None or not self.disk.on:
            return None
        ranked = sorted(
            (
                (_start(e.ids, e.trimmable, e.snapshot_at, common_prefix(e.ids, ids), limit), e)
                for e in self.disk.entries.values()
            ),
            key=lambda ne: -ne[0],
        )
        for n, e in ranked:
            if n <= ram_best or n < self._min_start:
                return None
            key = tuple(int(t) for t in e.ids)
            if key in self._entries:
                continue
            loaded = self.disk.read(e.key)
            if loaded is not None and self._add(key, *loaded):
                return key, n
        return None

    def flush(self) -> int:
        """Write every RAM entry to the disk tier (at shutdown); how many it took."""
        if self.disk is None:
            return 0
        return sum(self.disk.write(key, e.cache, e.snapshots, e.trimmable) for key, e in self._entries.items())

    def copy_budget(self) -> int | None:
        """The most bytes of copies worth holding for this cache at once: its RAM budget (an entry past it is
        refused or evicts others), None with a disk tier (which takes the evicted entries)."""
        return self.max_bytes if self.disk is None else None

    def insert(self, prefix: CachedPrefix) -> bool:
        """Store a finished request's caches (with its block snapshots that the caches can complete); False when
        they alone exceed the budget, or were made with another first chunk than `full_chunk` asks for."""
        if prefix.full_chunk != self.full_chunk:
            return False
        return self._add(tuple(prefix.tokens), prefix.cache, dict(prefix.snapshots), prefix.draft)

    def _add(self, key: tuple[int, ...], cache: list, snapshots: dict[int, list], draft: Any = None) -> bool:
        trimmable = _trimmable(cache)
        snapshots = (
            {}
            if trimmable
            else {
                n: layers
                for n, layers in snapshots.items()
                if 0 < n < len(key) and all(s is not None or c.is_trimmable() for s, c in zip(layers, cache))
            }
        )
        sizes = {n: cache_nbytes([c for c in layers if c is not None]) for n, layers in snapshots.items()}
        nbytes = cache_nbytes(cache) + sum(sizes.values()) + (draft.nbytes if draft is not None else 0)
        for n in sorted(snapshots, reverse=True):  # past the budget, the latest snapshots go first: shared
            if nbytes <= self.max_bytes:  # prefixes (system prompts, tool lists) are the early ones
                break
            del snapshots[n]
            nbytes -= sizes[n]
        if not key or nbytes > self.max_bytes:
            return False
        self._remove(key)
        entry = _Entry(np.asarray(key, dtype=np.int64), cache, nbytes, trimmable, snapshots, draft, next(self._clock))
        if entry.trimmable:  # a trimmable entry serves every prefix of itself: drop those (but a draft's state)
            prefixes = []
            for (k, e), common in self._index.nearest(key, entry.ids):  # an entry is a prefix: it shares all of it
                if common == 0:
                    break
                if common == len(k) < len(key) and e.draft is None:
                    prefixes.append(k)
            for other in prefixes:
                self._remove(other)
        self._entries[key] = entry
        self._index.add(key, entry.ids, (key, entry))
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            if self.disk is not None:
                evicted = self._entries[oldest]
                self.disk.write(oldest, evicted.cache, evicted.snapshots, evicted.trimmable)
            self._remove(oldest)
        return True

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._index.remove(key)
            self.bytes -= entry.nbytes
