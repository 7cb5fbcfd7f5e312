"""Rotating KV cache for sliding-window attention.

Holds at most `max_size` tokens (plus, during a multi-token prefill, the
window's worth of history the new tokens need). Single-token updates write in
place and wrap around; multi-token updates first put the buffer back in
temporal order and concatenate. The physical key order matters to the bits:
attention sums over keys in buffer order, so this follows mlx-lm's layout.
"""

from __future__ import annotations

import mlx.core as mx

from engine.masks import causal_mask


def grown_window(buf_keys, buf_values, keys: mx.array, values: mx.array, filled: int, step: int, max_size: int):
    """The window's buffers grown by one step when the next in-place write needs room, else None.

    Buffers grow `step` tokens at a time until they reach `max_size`; after that
    writes wrap around. Shared by the single-row and the batched cache, whose
    buffers must grow identically for the bits to match mlx-lm's.
    """
    if buf_keys is not None and not (filled >= buf_keys.shape[2] and buf_keys.shape[2] < max_size):
        return None
    b, heads, _, k_dim = keys.shape
    size = min(step, max_size - filled)
    new_k = mx.zeros((b, heads, size, k_dim), keys.dtype)
    new_v = mx.zeros((b, heads, size, values.shape[3]), values.dtype)
    if buf_keys is None:
        return new_k, new_v
    return mx.concatenate([buf_keys, new_k], axis=2), mx.concatenate([buf_values, new_v], axis=2)


class RotatingKVCache:
    step = 256

    def __init__(self, max_size: int, keep: int = 0):
        self.max_size = max_size
        self.keep = keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._idx = 0  # next write position in the buffer

    def _trim(self, trim_size: int, v: mx.array, append: mx.array | None = None) -> mx.array:
        parts = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]] if trim_size > 0 else [v]
        if append is not None:
            parts.append(append)
        return mx.concatenate(parts, axis=2)

    def _temporal_order(self, v: mx.array) -> mx.array:
        if self._idx == v.shape[2]:
            return v
        if self._idx < self.offset:
            return mx.concatenate(
                [v[..., : self.keep, :], v[..., self._idx :, :], v[..., self.keep : self._idx, :]], axis=2
            )
        return v[..., : self._idx, :]

    def _update_concat(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = self.keys.shape[2]
            # Keep max_size - 1 old tokens so every new token sees a full window.
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        prev = self.offset
        grown = grown_window(self.keys, self.values, keys, values, prev, self.step, self.max_size)
        if grown is not None:
            self.keys, self.values = grown
            self._idx = prev
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        self.keys[..., self._idx : self._idx + n, :] = keys
        self.values[..., self._idx : self._idx + n, :] = values
        self.offset += n
        self._idx += n
        return self.fetch()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def fetch(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def make_mask(self, n: int, window_size: int | None = None):
        if n > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + n > window_size:
                return causal_mask(n, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        # A window narrower than the buffer needs an explicit mask once full.
        if self.offset >= window_size and self.max_size > window_size:
            idx = 0 if self._idx >= self.max_size else self._idx
            size = self.offset + 1 if self.offset < self.max_size else self.max_size
            mask = mx.arange(size) >= (size - window_size)
            return mx.roll(mask, shift=idx + 1)
        return None

    @property
    def state(self):
        if self.keys is None:
            return []
        return list(self.fetch())

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
