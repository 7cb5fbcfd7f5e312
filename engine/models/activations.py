"""Compiled elementwise activations (one fused kernel each, as in mlx-lm).

Compiling these is both what mlx-lm does (so the bits match) and a speed
lever: small elementwise ops are dispatch-bound.
"""

from functools import partial

import mlx.core as mx
import mlx.nn as nn


@partial(mx.compile, shapeless=True)
def swiglu(gate, x):
    return nn.silu(gate) * x


@partial(mx.compile, shapeless=True)
def precise_swiglu(h, gate, x):
    gate = nn.silu(gate.astype(mx.float32))
    return (gate * x.astype(mx.float32)).astype(h.dtype)


@partial(mx.compile, shapeless=True)
def clip_residual(x, y):
    """x + y, clipped to the float16 range when running in float16 (gemma)."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)
