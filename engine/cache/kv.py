"""Growing KV cache: keys/values in buffers that grow 256 tokens at a time."""

from __future__ import annotations

import mlx.core as mx

from engine.masks import causal_mask


def owned_copies(arrays: list[mx.array]) -> list[mx.array]:
    """Copies of `arrays`, each to be written to a new buffer of exactly its size; not evaluated here.

    For caches that outlive the arrays they were sliced from (a row extracted
    from a batch, kept in the prompt cache), so that they hold exactly the
    bytes they count: an unevaluated slice keeps its whole source alive
    through its graph, and mx.contiguous of a row-contiguous slice keeps the
    source buffer when that is at most 16 KiB larger (MLX's Contiguous rule).
    A concatenation always writes a new buffer. Whoever extracts evaluates
    what it extracted in one call (`engine.cache.own`): an mx.async_eval
    costs the calling thread ~0.1 ms, which a call per layer of every row
    finishing in a step of 64 turns into most of a second.
    """
    return [mx.concatenate([x, x[:0]]) for x in arrays]


def standard_mask(n: int, offset: int, window_size: int | None):
    """mlx-lm's cache mask rule: an array with a window, None for one token, else "causal"."""
    if window_size is not None:
        return causal_mask(n, offset, window_size=window_size)
    if n == 1:
        return None
    return "causal"


class OffsetTrimmed:
    """Caches whose contents are the first `offset` positions of a buffer: trimming
    just moves `offset` back (the stale tail is overwritten by the next update)."""

    offset: int

    def make_mask(self, n: int, window_size: int | None = None):
        return standard_mask(n, self.offset, window_size)

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


class KVCache(OffsetTrimmed):
    step = 256

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.append(keys, values)
        return self.fetch()

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Write `keys`/`values` [B, heads, n, D] at the offset (growing the buffers a step at a time); the
        first `offset` positions of `self.keys`/`self.values` are then the cache."""
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            b, heads, _, k_dim = keys.shape
            v_dim = values.shape[3]
            size = ((self.step + n - 1) // self.step) * self.step
            new_k = mx.zeros((b, heads, size, k_dim), keys.dtype)
            new_v = mx.zeros((b, heads, size, v_dim), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
        self.offset += n
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values

    def fetch(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    @property
    def state(self):
        if self.keys is None:
            return []
        return list(self.fetch())

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
