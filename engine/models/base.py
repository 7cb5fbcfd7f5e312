"""What every model file shares: config parsing, projections and attention dispatch (masks: engine/masks.py).

Numerics follow mlx-lm exactly (same ops, same order, same string "causal"
mask where mlx-lm uses it), because the parity gate compares logits bit for
bit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})


def project(x: mx.array, *layers) -> tuple:
    """Each layer applied to x, in order. The fast tier's quantized layers run the ones that share this
    input as one kernel launch (`project_together`); every other layer runs on its own, as mlx-lm's do."""
    together = getattr(layers[0], "project_together", None)
    return together(x, layers) if together is not None else tuple(layer(x) for layer in layers)


def _quantized_sdpa(queries, q_keys, q_values, scale, mask, group_size, bits):
    b, n_q_heads, length, dim = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    repeats = n_q_heads // n_kv_heads
    queries = queries * scale
    if repeats > 1:
        queries = mx.reshape(queries, (b, n_kv_heads, repeats, length, dim))
        q_keys = tuple(mx.expand_dims(x, axis=-3) for x in q_keys)
        q_values = tuple(mx.expand_dims(x, axis=-3) for x in q_values)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        if isinstance(mask, str):
            q_len, k_len = scores.shape[-2:]
            mask = mx.arange(k_len - q_len, k_len)[:, None] >= mx.arange(k_len)[None]
        if repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    if repeats > 1:
        out = mx.reshape(out, (b, n_q_heads, length, dim))
    return out


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask):
    """Fused attention, or the quantized-KV path when the cache stores packed keys."""
    if hasattr(cache, "bits"):
        return _quantized_sdpa(queries, keys, values, scale, mask, cache.group_size, cache.bits)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
