"""What every model file shares: config parsing, masks and attention dispatch.

Numerics follow mlx-lm exactly (same ops, same order, same string "causal"
mask where mlx-lm uses it), because the parity gate compares logits bit for
bit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

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


def causal_mask(
    n: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    left_padding: Optional[mx.array] = None,
) -> mx.array:
    """Boolean mask [n, offset + n] (or [B, 1, n, offset + n] with left padding)."""
    cols = mx.arange(offset + n)
    rows = mx.arange(offset, offset + n) if offset else cols
    rows, cols = rows[:, None], cols[None]
    mask = rows >= cols
    if window_size is not None:
        mask = mask & (rows < cols + window_size)
    if left_padding is not None:
        mask = mask & (mx.expand_dims(left_padding, (1, 2, 3)) <= cols)
    return mask


def attention_mask(h: mx.array, cache=None, window_size: Optional[int] = None):
    """The mask for a forward of h.shape[1] tokens: None, "causal" or an array."""
    n = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(n, window_size=window_size)
    if n == 1:
        return None
    if window_size and n > window_size:
        return causal_mask(n, window_size=window_size)
    return "causal"


def recurrent_mask(h: mx.array, cache=None):
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(h.shape[1])
    return None


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
