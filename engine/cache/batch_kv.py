"""Growing KV cache for a batch of rows at different positions.

Rows are right-aligned in one [B, H, S, D] buffer: row b's tokens occupy
columns [left_padding[b], idx), so the token being decoded is one column for
every row and a single write position `idx` serves the batch. Each row keeps
its own absolute position (`offset`, for RoPE) and a boolean mask hides its
padding. Layout, growth and the trim of shared padding on `filter` follow
mlx-lm's BatchKVCache, which the same-B oracle runs.

Padding lives in Python ints, so no operation here waits on the device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from engine.cache.kv import KVCache, standard_mask
from engine.models.base import causal_mask


class BatchKVCache:
    step = 256

    def __init__(self, left_padding: Sequence[int]):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.left_padding = list(left_padding)
        self.idx = 0
        self._offset_array: Optional[mx.array] = None

    # --------------------------------------------------------------- shape

    @property
    def batch_size(self) -> int:
        return len(self.left_padding)

    @property
    def is_padded(self) -> bool:
        return any(self.left_padding)

    @property
    def offsets(self) -> list[int]:
        """Each row's absolute position: tokens it holds."""
        return [self.idx - p for p in self.left_padding]

    @property
    def offset(self):
        """RoPE offset: per-row positions (one array per forward), or an int when no row is padded."""
        if not self.is_padded:
            return self.idx
        if self._offset_array is None:
            self._offset_array = mx.array(self.offsets)
        return self._offset_array

    def _changed(self) -> None:
        self._offset_array = None

    # --------------------------------------------------------------- forward

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.idx
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            b, heads, _, k_dim = keys.shape
            size = ((self.step + n - 1) // self.step) * self.step
            new_k = mx.zeros((b, heads, size, k_dim), keys.dtype)
            new_v = mx.zeros((b, heads, size, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
        self.idx += n
        self._changed()
        self.keys[..., prev : self.idx, :] = keys
        self.values[..., prev : self.idx, :] = values
        return self.fetch()

    def fetch(self):
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :]

    def make_mask(self, n: int, window_size: Optional[int] = None):
        if not self.is_padded:  # unpadded: the serial graph's mask
            return standard_mask(n, self.idx, window_size)
        return causal_mask(n, self.idx, window_size=window_size, left_padding=mx.array(self.left_padding))

    # ---------------------------------------------------------- batch edits

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "BatchKVCache":
        """Right-align single-row caches into one batch (mlx-lm's merge)."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches))
        padding = [longest - n for n in lengths]
        filled = [c for c in caches if c.keys is not None]
        heads = max(c.keys.shape[1] for c in filled)
        k_dim = max(c.keys.shape[3] for c in filled)
        v_dim = max(c.values.shape[3] for c in filled)
        dtype = filled[0].keys.dtype
        keys = mx.zeros((len(caches), heads, longest, k_dim), dtype=dtype)
        values = mx.zeros((len(caches), heads, longest, v_dim), dtype=dtype)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            keys[i : i + 1, :, p : p + c.offset] = c.keys[..., : c.offset, :]
            values[i : i + 1, :, p : p + c.offset] = c.values[..., : c.offset, :]
        cache = cls(padding)
        cache.keys, cache.values, cache.idx = keys, values, longest
        return cache

    def extend(self, other: "BatchKVCache") -> None:
        """Append other's rows below ours, right-aligning both to the longer one."""
        self._changed()
        if self.keys is None and other.keys is None:
            self.left_padding += other.left_padding
            return
        longest = max(self.idx, other.idx)
        ref = self.keys if self.keys is not None else other.keys
        heads, k_dim = ref.shape[1], ref.shape[3]
        v_dim = (self.values if self.values is not None else other.values).shape[3]
        width = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)

        def aligned(c: "BatchKVCache"):
            k, v = c.keys, c.values
            if k is None:
                k = mx.zeros((c.batch_size, heads, 0, k_dim), dtype=ref.dtype)
                v = mx.zeros((c.batch_size, heads, 0, v_dim), dtype=ref.dtype)
            left = longest - c.idx
            right = width - k.shape[2] - left
            if right < 0:
                k, v = k[..., :right, :], v[..., :right, :]
                right = 0
            if left or right:
                pad = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = mx.pad(k, pad), mx.pad(v, pad)
            return k, v, [p + left for p in c.left_padding]

        (k1, v1, p1), (k2, v2, p2) = aligned(self), aligned(other)
        self.keys = mx.concatenate([k1, k2])
        self.values = mx.concatenate([v1, v2])
        self.left_padding = p1 + p2
        self.idx = longest

    def filter(self, keep: Sequence[int]) -> None:
        """Keep these rows (in this order), then drop padding every survivor shares."""
        self._changed()
        if self.keys is not None:
            rows = mx.array(list(keep))
            self.keys, self.values = self.keys[rows], self.values[rows]
        self.left_padding = [self.left_padding[i] for i in keep]
        shared = min(self.left_padding) if self.left_padding else 0
        if shared > 0:
            if self.keys is not None:
                self.keys = self.keys[..., shared:, :]
                self.values = self.values[..., shared:, :]
            self.idx -= shared
            self.left_padding = [p - shared for p in self.left_padding]

    def extract(self, row: int) -> KVCache:
        """One row as a fresh single-row cache (a copy: the batch may change)."""
        cache = KVCache()
        start = self.left_padding[row]
        cache.keys = mx.contiguous(self.keys[row : row + 1, :, start : self.idx])
        cache.values = mx.contiguous(self.values[row : row + 1, :, start : self.idx])
        cache.offset = cache.keys.shape[2]
        return cache

    # ------------------------------------------------------------- reporting

    @property
    def state(self):
        return [] if self.keys is None else list(self.fetch())

    def size(self) -> int:
        return self.idx

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
