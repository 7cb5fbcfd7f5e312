"""Affine-quantized KV cache for a batch of rows.

The same right-aligned layout as BatchKVCache, storing the packed codes,
scales and biases of keys and values (six parts on one token axis). Tokens
are quantized per token along the head dimension, so a row's stored bytes
equal what a serial QuantizedKVCache holds for it. Like the serial scheme
(mlx-lm's kv_bits), a joiner's cache is full precision during a prefill chunk
and converted right after it (`BatchQuantizedKVCache.from_full`): the chunk attends
to full-precision keys. mlx-lm has no batched quantized cache; this
composition's oracle is our serial quantized path
(tests/parity/test_batched_quantized_kv.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.cache.batch_kv import BatchKVCache
from engine.cache.quantized import QuantizedKVCache


class BatchQuantizedKVCache(BatchKVCache):
    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits  # the attention dispatch looks for this attribute

    @classmethod
    def from_full(cls, full: BatchKVCache, group_size: int, bits: int) -> BatchQuantizedKVCache:
        """The same rows as `full`, stored as affine codes (quantized per token along the head dimension)."""
        q = cls(full.left_padding, group_size=group_size, bits=bits)
        q.idx = full.idx
        if full.parts is not None:
            keys, values = full.parts
            q.parts = [
                *mx.quantize(keys, group_size=group_size, bits=bits),
                *mx.quantize(values, group_size=group_size, bits=bits),
            ]
        return q

    def _new_parts(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        q = dict(group_size=self.group_size, bits=self.bits)
        return [*mx.quantize(keys, **q), *mx.quantize(values, **q)]

    def _fetched(self, parts: list[mx.array]):
        return tuple(parts[:3]), tuple(parts[3:])

    @staticmethod
    def _single_parts(cache: QuantizedKVCache) -> list[mx.array] | None:
        return None if cache.keys is None else [*cache.keys, *cache.values]

    def _single(self, parts: list[mx.array]) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        cache.keys, cache.values = tuple(parts[:3]), tuple(parts[3:])
        cache.offset = parts[0].shape[2]
        return cache
