"""Gated DeltaNet prefill in chunks: a few matrix products per 64 tokens
instead of a chain of small kernels per token.

The recurrence (engine/models/gated_delta.py), per head with state S [Dv, Dk]:

    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,    y_t = S_t q_t

Within a chunk starting from state S0, with G_i = g_1 ... g_i, every S_i is
G_i S0 + sum_{j<=i} (G_i / G_j) u_j k_j^T for "pseudo-values" u_j that solve
the lower-triangular system (the WY / UT form of flash-linear-attention's
`chunk_gated_delta_rule`):

    (I + A) U = diag(beta) V - diag(beta G) K S0^T,
    A_ij = beta_i (G_i / G_j) k_i.k_j  for j < i.

With T = (I + A)^-1, W = T diag(beta G) K and U~ = T diag(beta) V depend on
the chunk alone and are computed for all chunks at once; only
U = U~ - W S0^T and the next state G_C S0 + U^T diag(G_C / G) K run chunk
after chunk (two products a chunk: every operation in that loop is a graph
node the host submits, ~20 a chunk before), and the outputs
Y = diag(G) Q S0^T + ((Q K^T) * decay) U of all chunks are two batched
products after it. A is strictly
lower triangular, so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)... ends after
log2(C) factors: ten matrix products, no per-row substitution.

All of it in float32 from the same inputs as the recurrence; the sums run in
another order, so outputs and state agree to rounding (the fast tier).
It takes log g, not g: a head that forgets at once has g = 0 in float32 but a
finite log g, and a gradient through log(g) would carry a factor 1/g that
overflows in training. Padding past the last token uses log g = 0 and beta =
0, which leaves the state as it is; positions a batch mask marks as padding
get the same treatment.

The state after a count of tokens inside the forward (`marks`, the prompt
cache's block snapshots) is the state after a chunk where the count ends one;
inside a chunk, after its first l tokens, it is G_l S0 + U^T diag(G_l / G) K
over those l rows: one more product of the chunk's size, so any count costs
about a chunk's state update and no forward is cut.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial

import mlx.core as mx

from engine.models.gated_delta import repeat_heads

CHUNK = 64
# (q, k, v, log_g, beta, chunk) -> prepare_chunks' tuple: see chunked_gated_delta
PrepareKernel = Callable[..., tuple[mx.array, ...]]
# (u_tilde, w, k_decayed, chunk_decay, state) -> (S^T at each chunk's start, U, final state): see chunked_gated_delta
StatesKernel = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]
LOG_FLOOR = -69.0  # the smallest log decay the chunked form takes (g = 1e-30: a state forgotten to rounding)


@cache
def _constants(size: int) -> tuple[mx.array, mx.array, mx.array]:
    """The lower-triangular and strictly lower-triangular masks and the identity [C, C] (float32), made once:
    evaluated arrays add no graph nodes to a forward."""
    out = (
        mx.tril(mx.ones((size, size), dtype=mx.bool_)),
        mx.tril(mx.ones((size, size), dtype=mx.bool_), k=-1),
        mx.eye(size, dtype=mx.float32),
    )
    mx.eval(out)
    return out


def _inverse_unit_lower(a: mx.array, size: int) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], by doubling."""
    x = -a
    eye = _constants(size)[2].astype(a.dtype)
    inv = eye + x
    power = x
    span = 2
    while span < size:
        power = power @ power
        inv = inv + inv @ power
        span *= 2
    return inv


@partial(mx.compile, shapeless=False)
def _prepare(q, k, v, log_g, beta, size: int):
    """Per-chunk quantities independent of the state: inputs [B, H, N, C, D] / [B, H, N, C]; then, for states
    inside a chunk, the decays G_i / G_j [B, H, N, C, C] (zero for j > i) and G [B, H, N, C]."""
    cum, decay, gamma = _decays(log_g, size)
    strict = _constants(size)[1]
    kk = k @ k.swapaxes(-1, -2)
    a = mx.where(strict, beta[..., :, None] * decay * kk, 0.0)
    inv = _inverse_unit_lower(a, size)
    w = inv @ ((beta * gamma)[..., None] * k)
    u_tilde = inv @ (beta[..., None] * v)
    qk = (q @ k.swapaxes(-1, -2)) * decay
    q_decayed = gamma[..., None] * q
    last = cum[..., -1:]
    k_decayed = mx.exp(last - cum)[..., None] * k
    return (u_tilde, w, q_decayed, qk, k_decayed, gamma[..., -1]), (decay, gamma)


def _decays(log_g, size: int):
    """The cumulative log decays [B, H, N, C] (floored: the sums' rounding stays small), G_i / G_j [B, H, N, C, C]
    (zero for j > i) and G [B, H, N, C] of chunked log g."""
    cum = mx.cumsum(mx.maximum(log_g, LOG_FLOOR), axis=-1)
    diff = cum[..., :, None] - cum[..., None, :]
    return cum, mx.exp(mx.where(_constants(size)[0], diff, -mx.inf)), mx.exp(cum)


def _blocks(x: mx.array, chunk: int) -> mx.array:
    """x [B, T, H, ...] as float32 chunks [B, H, N, C, ...], zeros past T."""
    b, t, h = x.shape[:3]
    n = -(-t // chunk)
    x = x.astype(mx.float32)
    if n * chunk > t:
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, n * chunk - t)
        x = mx.pad(x, widths)
    return mx.moveaxis(x.reshape(b, n, chunk, h, *x.shape[3:]), 3, 1)


def prepare_chunks(q, k, v, log_g, beta, chunk: int = CHUNK) -> tuple[mx.array, ...]:
    """The chunk-local part as MLX operations: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; log_g, beta [B, T, Hv]
    float32 (a batch mask applied) -> (U~, W, diag(G) Q, (Q K^T) * decays, decayed K [B, Hv, N, C, ...], the
    chunks' decays [B, Hv, N]), float32 (`gated_delta_prepare.chunk_prepare`'s contract)."""
    q, k = repeat_heads(q, k, v.shape[2])
    return _prepare(*(_blocks(x, chunk) for x in (q, k, v, log_g, beta)), chunk)[0]


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
    chunk: int = CHUNK,
    marks: dict[int, mx.array | None] | None = None,
    states: StatesKernel | None = None,
    prepare: PrepareKernel | None = None,
) -> tuple[mx.array, mx.array]:
    """The contract of `recurrence` with log g for g: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
    log_g, beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32; mask [B, T] or None;
    returns (y [B, T, Hv, Dv] in q's dtype, final state). `marks` (token count in
    1..T: None) receives the state after each of its counts. `states` (`gated_delta_states.chunk_states`
    on CUDA) runs the chunk-after-chunk part as one launch instead of the loop of MLX operations, `prepare`
    (`gated_delta_prepare.chunk_prepare`) the chunk-local part as one launch instead of `prepare_chunks`."""
    out_dtype = q.dtype
    b, t, h, dv = v.shape
    log_g = log_g.astype(mx.float32)
    beta = beta.astype(mx.float32)
    if mask is not None:
        keep = mask[..., None]
        log_g = mx.where(keep, log_g, 0.0)
        beta = mx.where(keep, beta, 0.0)
    n = -(-t // chunk)
    u_tilde, w, q_decayed, qk, k_decayed, chunk_decay = (prepare or prepare_chunks)(q, k, v, log_g, beta, chunk)
    if any(count % chunk for count in marks or ()):  # a state inside a chunk takes its decays and keys
        k = _blocks(repeat_heads(q, k, h)[1], chunk)
        decay, gamma = _decays(_blocks(log_g, chunk), chunk)[1:]
    if states is not None:
        starts, us, final = states(u_tilde, w, k_decayed, chunk_decay, state)
        for count in marks or ():
            i, rows = divmod(count, chunk)
            if rows:
                marks[count] = _inside(k, decay, gamma, i, rows, starts[:, :, i : i + 1], us[:, :, i : i + 1])
            else:
                marks[count] = final if i == n else _untransposed(starts[:, :, i : i + 1])
        y = q_decayed @ starts + qk @ us
        y = y.reshape(b, h, n * chunk, dv)[:, :, :t]
        return y.swapaxes(1, 2).astype(out_dtype), final
    # Only the states at the chunks' starts run chunk after chunk (two products a chunk, on views of one split
    # a part); the outputs of all chunks are then two batched products. The state runs transposed (S^T
    # [Dk, Dv]), as the products take it.
    ws, kds, decays = (_chunks(x, n) for x in (w, k_decayed.swapaxes(-1, -2), chunk_decay[..., None, None]))
    u_tildes = _chunks(u_tilde, n)
    within = {}  # chunk: the counts that end inside it
    for count in marks or ():
        if count % chunk:
            within.setdefault(count // chunk, []).append(count)
    st = state.swapaxes(-1, -2)[:, :, None]  # [B, H, 1, Dk, Dv]
    starts, us = [], []
    for i in range(n):
        u = u_tildes[i] - ws[i] @ st
        starts.append(st)
        us.append(u)
        for count in within.get(i, ()):
            marks[count] = _inside(k, decay, gamma, i, count % chunk, st, u)
        st = _advance(decays[i], st, kds[i] @ u)
        if marks is not None and (i + 1) * chunk in marks:
            marks[(i + 1) * chunk] = _untransposed(st)
    y = q_decayed @ _joined(starts) + qk @ _joined(us)  # [B, H, N, C, Dv]
    y = y.reshape(b, h, n * chunk, dv)[:, :, :t]
    return y.swapaxes(1, 2).astype(out_dtype), _untransposed(st)


def _inside(k, decay, gamma, i: int, rows: int, st: mx.array, u: mx.array) -> mx.array:
    """The state after the first `rows` tokens of chunk i, from the state at its start (S^T [B, H, 1, Dk, Dv])
    and its U: G_l S0 + U^T diag(G_l / G) K over those rows, as the rule's [B, H, Dv, Dk]."""
    last = rows - 1
    keys = (decay[:, :, i, last, :, None] * k[:, :, i]).swapaxes(-1, -2)[:, :, None]
    return _untransposed(gamma[:, :, i, last, None, None, None] * st + keys @ u)


@partial(mx.compile, shapeless=True)
def _advance(decay: mx.array, st: mx.array, update: mx.array) -> mx.array:
    """The running state at the next chunk's start (one fused kernel)."""
    return decay * st + update


def _chunks(x: mx.array, n: int) -> list[mx.array]:
    """x [B, H, N, ...] as N views [B, H, 1, ...] (one split)."""
    return mx.split(x, n, axis=2) if n > 1 else [x]


def _joined(xs: list[mx.array]) -> mx.array:
    return mx.concatenate(xs, axis=2) if len(xs) > 1 else xs[0]


def _untransposed(st: mx.array) -> mx.array:
    """A running state [B, H, 1, Dk, Dv] as the rule's [B, H, Dv, Dk]."""
    return st[:, :, 0].swapaxes(-1, -2)
