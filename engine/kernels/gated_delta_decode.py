"""A Gated DeltaNet layer's decode step (one token) as one compiled function.

Between its input projections and its output projection a DeltaNet layer runs
~20 small operations per token: the conv tail update, the depthwise conv and
SiLU, q/k normalization, the gates, the delta step and the gated RMS norm.
Each is a graph node the host builds and a kernel the device launches; for a
27B hybrid that is ~1,000 of a decode step's ~2,000 operations. Compiled
together, the host builds one call and MLX fuses the elementwise chains.

The depthwise conv over the K = 4 positions is written as a multiply and a sum
(one output position), which fuses; the rest are the exact tier's functions.
Fusion keeps float32 intermediates where the exact graph rounds, so this is
the fast tier: equal to the exact step up to rounding.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from engine.models.activations import precise_swiglu
from engine.models.gated_delta import _step, decay, normalize_qk, repeat_heads


def applies(x: mx.array, mask, cache) -> bool:
    """One token, a plain serial cache that already holds both states, nothing recorded."""
    return (
        x.shape[1] == 1
        and mask is None
        and cache is not None
        and cache.lengths is None
        and cache.trace is None
        and cache[0] is not None
        and cache[1] is not None
    )


@lru_cache(maxsize=None)
def _core(hk: int, hv: int, dk: int, dv: int, norm_eps: float):
    key_dim = hk * dk

    def core(qkv, z, a, b, conv_state, state, conv_w, A_log, dt_bias, norm_w):
        batch = qkv.shape[0]
        conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K, C]
        conv = nn.silu((conv_input * conv_w[:, :, 0].T).sum(axis=1))  # [B, C]
        q = conv[:, :key_dim].reshape(batch, 1, hk, dk)
        k = conv[:, key_dim : 2 * key_dim].reshape(batch, 1, hk, dk)
        v = conv[:, 2 * key_dim :].reshape(batch, hv, dv)
        q, k = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
        q, k = repeat_heads(q, k, hv)
        g = decay(A_log, a, dt_bias)[:, 0]
        y, state = _step(q[:, 0], k[:, 0], v, g, mx.sigmoid(b)[:, 0], state)
        out = precise_swiglu(y, z[:, 0], mx.fast.rms_norm(y, norm_w, norm_eps))
        return out.reshape(batch, 1, hv * dv), conv_input[:, 1:, :], state

    return mx.compile(core)


def fused_decode(layer, x: mx.array, mask, cache) -> Optional[mx.array]:
    """The layer's output for one token (before `out_proj`), updating `cache` as
    the layer does; None where the step does not apply (the layer's own path runs)."""
    if not applies(x, mask, cache):
        return None
    b = x.shape[0]
    core = _core(layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, layer.norm.eps)
    qkv, z, beta_logits, a = layer.input_projections(x)
    out, cache[0], cache[1] = core(
        qkv,
        z.reshape(b, 1, layer.num_v_heads, layer.head_v_dim),
        a,
        beta_logits,
        cache[0],
        cache[1],
        layer.conv1d.weight,
        layer.A_log,
        layer.dt_bias,
        layer.norm.weight,
    )
    cache.advance(1)
    return out
