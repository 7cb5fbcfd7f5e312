"""Rotating (sliding-window) KV cache for a batch of rows.

The batched counterpart of RotatingKVCache: one [B, H, W, D] ring shared by
all rows, a write index `idx`, a `rotated` flag once the ring has wrapped,
and per-row left padding that goes negative as a row's oldest tokens fall
out of the window. Every step of this bookkeeping follows mlx-lm's
BatchRotatingKVCache, because the physical key order decides the bits of the
attention sum and the same-B oracle runs mlx-lm's cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.cache.batch_kv import roll_rows
from engine.cache.kv import owned_copies
from engine.cache.rotating import RotatingKVCache, grown_window


class BatchRotatingKVCache:
    step = 256

    def __init__(self, max_size: int, left_padding: Sequence[int]):
        self.max_size = max_size
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.left_padding = list(left_padding)
        self.offsets = [-p for p in left_padding]  # absolute position of each row
        self.idx = 0  # write index in the ring
        self.tokens = 0  # tokens written since creation (mlx-lm's _offset)
        self.rotated = False
        self._offset_array: mx.array | None = None
        # During a right-padded prefill: where each row's real tokens end.
        self._lengths: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.left_padding)

    @property
    def offset(self) -> mx.array:
        if self._offset_array is None:
            self._offset_array = mx.array(self.offsets)
        return self._offset_array

    def _advance(self, n: int) -> None:
        self.offsets = [o + n for o in self.offsets]
        self.tokens += n
        self._offset_array = None

    def _shift_padding(self, n: int) -> None:
        self.left_padding = [p - n for p in self.left_padding]

    def _roll_padding_left(self) -> None:
        """Rows whose latest tokens are padding: roll them right so padding never evicts real tokens."""
        roll = [max(0, o - n) for o, n in zip(self.offsets, self._lengths)]
        self.keys = roll_rows(self.keys, roll)
        self.values = roll_rows(self.values, roll)
        self.left_padding = [p + r for p, r in zip(self.left_padding, roll)]
        self.offsets = [o - r for o, r in zip(self.offsets, roll)]
        self._offset_array = None

    def _to_temporal_order(self) -> None:
        if self.rotated:
            self.keys = mx.roll(self.keys, -self.idx, axis=2)
            self.values = mx.roll(self.values, -self.idx, axis=2)
            self.idx = self.keys.shape[2]
            self.rotated = False

    # --------------------------------------------------------------- forward

    def _update_concat(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self._to_temporal_order()
            if self.keys.shape[2] > self.idx:
                self.keys = self.keys[..., : self.idx, :]
                self.values = self.values[..., : self.idx, :]
            if self._lengths is not None:
                self._roll_padding_left()
            # Keep max_size - 1 old tokens so every new token sees a full window.
            trim = self.idx - self.max_size + 1
            if trim > 0:
                self._shift_padding(trim)
                self.keys = self.keys[..., trim:, :]
                self.values = self.values[..., trim:, :]
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self._advance(keys.shape[2])
        self.idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys: mx.array, values: mx.array):
        assert self._lengths is None, "finalize() the padded prefill before decoding"
        n = keys.shape[2]
        prev = self.tokens
        grown = grown_window(self.keys, self.values, keys, values, prev, self.step, self.max_size)
        if grown is not None:
            self.keys, self.values = grown
            self.idx = prev
        trim = self.keys.shape[2] - self.max_size
        if trim > 0:
            self.keys = self.keys[..., trim:, :]
            self.values = self.values[..., trim:, :]
            self.idx = self.max_size
            self._shift_padding(trim)
        if self.idx == self.max_size:
            self.rotated = True
            self.idx = 0
        if self.rotated:
            self._shift_padding(n)
        self.keys[..., self.idx : self.idx + n, :] = keys
        self.values[..., self.idx : self.idx + n, :] = values
        self._advance(n)
        self.idx += n
        return self.fetch()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def fetch(self):
        if self.tokens < self.keys.shape[2]:
            return self.keys[..., : self.tokens, :], self.values[..., : self.tokens, :]
        return self.keys, self.values

    def prepare(self, lengths: Sequence[int], right_padding: Sequence[int]) -> None:
        if max(right_padding) > 0:
            self._lengths = [n + o for n, o in zip(lengths, self.offsets)]

    def finalize(self) -> None:
        if self._lengths is not None:
            self._roll_padding_left()
            self._lengths = None

    def make_mask(self, n: int, window_size: int | None = None) -> mx.array:
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self.tokens)
        cols = mx.arange(offset + n)
        rows = (mx.arange(offset, offset + n) if offset else cols)[:, None]
        cols = cols[None]
        mask = (rows >= cols) & (rows < cols + window_size)
        padding = list(self.left_padding)
        trim = self.idx - self.max_size + int(n > 1)
        if trim > 0:
            padding = [p - trim for p in padding]
        rotated = n == 1 and (self.rotated or self.idx >= self.max_size)
        if rotated:
            padding = [p - 1 for p in padding]
        mask = mask & (cols >= mx.expand_dims(mx.array(padding), (1, 2, 3)))
        if rotated:
            idx = 0 if self.idx >= self.max_size else self.idx
            mask = mx.roll(mask, shift=idx + 1, axis=-1)
        return mask

    # ---------------------------------------------------------- batch edits

    @classmethod
    def merge(cls, caches: Sequence[RotatingKVCache]) -> BatchRotatingKVCache:
        if any(c.max_size != caches[0].max_size for c in caches):
            raise ValueError("rotating caches merge only with the same window size")
        max_size = caches[0].max_size
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls(max_size, [0] * len(caches))
        padding = [longest - n for n in lengths]
        filled = [c for c in caches if c.keys is not None]
        heads = max(c.keys.shape[1] for c in filled)
        k_dim = max(c.keys.shape[3] for c in filled)
        v_dim = max(c.values.shape[3] for c in filled)
        dtype = filled[0].keys.dtype
        keys = mx.zeros((len(caches), heads, longest, k_dim), dtype=dtype)
        values = mx.zeros((len(caches), heads, longest, v_dim), dtype=dtype)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches)):
            if c.keys is None:
                continue
            keys[i : i + 1, :, p : p + n] = c._temporal_order(c.keys)[..., -n:, :]
            values[i : i + 1, :, p : p + n] = c._temporal_order(c.values)[..., -n:, :]
        cache = cls(max_size, padding)
        cache.keys, cache.values = keys, values
        cache.offsets = [c.offset for c in caches]
        cache.idx = cache.tokens = longest
        return cache

    def extend(self, other: BatchRotatingKVCache) -> None:
        self._offset_array = None
        if self.keys is None and other.keys is None:
            self.left_padding += other.left_padding
            self.offsets += other.offsets
            return
        if self.rotated != other.rotated or self.idx != other.idx:
            self._to_temporal_order()
            other._to_temporal_order()
        longest = max(self.idx, other.idx)
        ref = self.keys if self.keys is not None else other.keys
        heads, k_dim = ref.shape[1], ref.shape[3]
        v_dim = (self.values if self.values is not None else other.values).shape[3]
        width = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)

        def aligned(c: BatchRotatingKVCache):
            left = longest - c.idx
            k, v = c.keys, c.values
            if k is None:
                k = mx.zeros((c.batch_size, heads, 0, k_dim), dtype=ref.dtype)
                v = mx.zeros((c.batch_size, heads, 0, v_dim), dtype=ref.dtype)
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
        self.offsets = self.offsets + other.offsets
        self.idx = longest
        self.tokens = max(self.tokens, other.tokens)

    def filter(self, keep: Sequence[int], trim: bool = True) -> None:
        """Keep these rows (in this order); a rotating cache keeps its padding either way (`trim`)."""
        self._offset_array = None
        if self.keys is not None:
            rows = mx.array(list(keep))
            self.keys, self.values = self.keys[rows], self.values[rows]
        self.offsets = [self.offsets[i] for i in keep]
        self.left_padding = [self.left_padding[i] for i in keep]

    def extract(self, row: int) -> RotatingKVCache:
        """One row as a fresh single-row cache in temporal order (copies that own their bytes)."""
        cache = RotatingKVCache(self.max_size)
        start = max(0, self.left_padding[row])
        keys, values = self.keys[row : row + 1], self.values[row : row + 1]
        end = self.idx
        if self.rotated:
            keys = mx.roll(keys, -self.idx, axis=2)
            values = mx.roll(values, -self.idx, axis=2)
            end = self.max_size
        cache.keys, cache.values = owned_copies([keys[:, :, start:end], values[:, :, start:end]])
        cache.offset = self.offsets[row]
        cache._idx = cache.keys.shape[2]
        return cache

    # ------------------------------------------------------------- reporting

    @property
    def state(self):
        return [] if self.keys is None else list(self.fetch())

    def size(self) -> int:
        return min(self.tokens, self.max_size)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
