"""Attention masks: what a forward of n tokens attends to, given its cache.

Models and caches both build them (a batch cache adds its rows' left padding),
so they live below both. Numerics follow mlx-lm: the string "causal" where
mlx-lm passes it, the same boolean mask otherwise.
"""

from __future__ import annotations

import mlx.core as mx


def causal_mask(
    n: int,
    offset: int = 0,
    window_size: int | None = None,
    left_padding: mx.array | None = None,
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


def attention_mask(h: mx.array, cache=None, window_size: int | None = None):
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
