"""Affine-quantized KV cache (4 or 8 bit): keys/values stored packed with scales and biases."""

from __future__ import annotations

import mlx.core as mx

from engine.cache.kv import KVCache, OffsetTrimmed


class QuantizedKVCache(OffsetTrimmed):
    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8):
        self.keys: tuple[mx.array, mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array, mx.array] | None = None
        self.offset = 0
        self.group_size = group_size
        self.bits = bits

    @classmethod
    def from_kv(cls, cache: KVCache, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """Quantize an existing growing cache (mlx-lm's `to_quantized`)."""
        q = cls(group_size=group_size, bits=bits)
        q.offset = cache.offset
        if cache.keys is not None:
            q.keys = tuple(mx.quantize(cache.keys, group_size=group_size, bits=bits))
            q.values = tuple(mx.quantize(cache.values, group_size=group_size, bits=bits))
        return q

    def _grow(self, b: int, heads: int, n: int, k_dim: int, v_dim: int, dtype) -> None:
        per_word = 32 // self.bits
        size = ((self.step + n - 1) // self.step) * self.step
        shape = (b, heads, size)

        def empty(dim):
            return (
                mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype),
            )

        if self.keys is None:
            self.keys, self.values = empty(k_dim), empty(v_dim)
            return
        prev = self.offset
        if prev % self.step != 0:
            self.keys = tuple(x[..., :prev, :] for x in self.keys)
            self.values = tuple(x[..., :prev, :] for x in self.values)

        def extend(x):
            return mx.concatenate([x, mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)], axis=-2)

        self.keys = tuple(extend(x) for x in self.keys)
        self.values = tuple(extend(x) for x in self.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        b, heads, n, k_dim = keys.shape
        prev = self.offset
        if self.keys is None or prev + n > self.keys[0].shape[-2]:
            self._grow(b, heads, n, k_dim, values.shape[-1], keys.dtype)
        self.offset += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self.offset, :] = qk[i]
            self.values[i][..., prev : self.offset, :] = qv[i]
        return self.fetch()

    def fetch(self):
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        return (
            tuple(x[..., : self.offset, :] for x in self.keys),
            tuple(x[..., : self.offset, :] for x in self.values),
        )

    @property
    def state(self):
        if self.keys is None:
            return []
        k, v = self.fetch()
        return [*k, *v]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))
