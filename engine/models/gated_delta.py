"""The gated delta rule recurrence used by Gated DeltaNet layers.

Per head, with a decay g_t in (0, 1) and a write strength beta_t in (0, 1):

    S_t = g_t * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t k_t))^T        (delta-rule write)
    y_t = S_t q_t

The state S is [Dv, Dk] per value head, float32 as mlx-lm keeps it; the fast
tier can hold it in bfloat16 (`state_dtype`), the math in float32 either way
and the state rounded once a token. This is the
sequential ops path, step for step the one mlx-lm runs on non-Metal devices
(the exact tier). The kernel tier passes `chunked` (engine/kernels): a prompt
chunk of at least CHUNKED_MIN_TOKENS then runs in 64-token blocks of matrix
products instead, equal to this path up to rounding.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn


@partial(mx.compile, shapeless=True)
def decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """g as mlx-lm computes it (one compiled kernel: the exact tier's bits)."""
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


@partial(mx.compile, shapeless=True)
def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g: finite where g itself underflows to 0, and its gradient has no 1/g."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)


def normalize_qk(q: mx.array, k: mx.array, *, inv_scale: float, eps: float):
    """L2-normalize q and k (eps added to sum(x^2)) and fold the Dk^-0.5 readout scale into q."""
    rms_eps = eps * inv_scale**2
    q = (inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps)
    k = inv_scale * mx.fast.rms_norm(k, None, rms_eps)
    return q, k


@mx.compile
def delta_step(q, k, v, g, beta, state, mask=None):
    """One token: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dv, Dk]."""
    old = state
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    if mask is not None:
        state = mx.where(mx.expand_dims(mask, axis=(1, 2, 3)), state, old)
    return y.astype(q.dtype), state


def repeat_heads(q: mx.array, k: mx.array, value_heads: int) -> tuple[mx.array, mx.array]:
    """Repeat the key heads (axis -2) of q and k to the value heads' count."""
    hk = q.shape[-2]
    if value_heads > hk:
        q = mx.repeat(q, value_heads // hk, -2)
        k = mx.repeat(k, value_heads // hk, -2)
    return q, k


def recurrence(
    q, k, v, g, beta, state, mask: mx.array | None = None, trace: list | None = None, marks: dict | None = None
):
    """Run the rule over T tokens: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv].

    The state keeps its dtype: each token's update is float32 and rounded to it.
    `trace`, when given, receives the state after every token (speculative
    decoding keeps the one after the last accepted token); `marks` (token
    count: None) the state after each of its counts (block snapshots).
    """
    q, k = repeat_heads(q, k, v.shape[2])
    dtype = state.dtype
    ys = []
    for t in range(q.shape[1]):
        y, state = delta_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t]
        )
        state = kept_as(state, dtype)
        ys.append(y)
        if trace is not None:
            trace.append(state)
        if marks is not None and t + 1 in marks:
            marks[t + 1] = state
    return mx.stack(ys, axis=1), state


def kept_as(state: mx.array, dtype: mx.Dtype) -> mx.array:
    """`state` in `dtype` (no operation when it already is)."""
    return state if state.dtype == dtype else state.astype(dtype)


# Below this many tokens (decode steps, verify windows) the per-token loop is cheaper.
CHUNKED_MIN_TOKENS = 16


def gated_delta_update(
    q, k, v, a, b, A_log, dt_bias, state=None, mask=None, trace=None, chunked=None, state_dtype=mx.float32, marks=None
):
    """Gates from (a, b), then the recurrence (or `chunked`, which takes the
    recurrence's arguments with log g in place of g, for long inputs that record no trace).
    A new state is made in `state_dtype`; a given one keeps its dtype, and so do
    the states `marks` (token count: None) receives after its counts.
    Returns (y [B, T, Hv, Dv], new state)."""
    beta = mx.sigmoid(b)
    if state is None:
        batch, _, _, dk = q.shape
        hv, dv = v.shape[-2:]
        state = mx.zeros((batch, hv, dv, dk), dtype=state_dtype)
    if chunked is not None and trace is None and q.shape[1] >= CHUNKED_MIN_TOKENS:
        extra = {} if marks is None else {"marks": marks}  # (a rule without marks serves forwards that ask none)
        y, new_state = chunked(q, k, v, log_decay(A_log, a, dt_bias), beta, state, mask, **extra)
        for n, s in (marks or {}).items():
            marks[n] = kept_as(s, state.dtype)
        return y, kept_as(new_state, state.dtype)
    return recurrence(q, k, v, decay(A_log, a, dt_bias), beta, state, mask, trace, marks)
