"""A Gated DeltaNet decoder layer's decode step (one token) as one compiled function, and its verify window.

Between its input projections and its output projection a DeltaNet layer runs
~20 small operations a token (the conv tail update, the depthwise conv and
SiLU, q/k normalization, the gates, the delta step, the gated RMS norm), and
around them come the norms, the residual adds and the MLP: each a graph node
the host builds and a kernel MLX launches. Compiled as one call, the host
builds one node a layer and MLX fuses the elementwise chains. The depthwise
conv over its K = 4 positions is a multiply and a sum (one output position),
which fuses; the rest are the exact tier's functions, with float32 kept where
the exact graph rounds: the fast tier, equal to the exact step to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import gated_delta_prefill, gated_delta_scan, gated_delta_step
from engine.kernels.layer_launches import normed_projections, residual_mlp
from engine.kernels.norm_handoff import LayerLink
from engine.kernels.quantized_gemv import Fusion
from engine.models.activations import precise_swiglu
from engine.models.gated_delta import CHUNKED_MIN_TOKENS, decay, delta_step, kept_as, normalize_qk, repeat_heads


def applies(x: mx.array, mask, cache) -> bool:
    """One token, a plain serial cache that already holds both states, nothing recorded."""
    return x.shape[1] == 1 and cache is not None and cache.trace is None and _plain(mask, cache)


def window_applies(x: mx.array, mask, cache) -> bool:
    """A speculative verify window: 2 tokens up to where the chunked rule takes over, the state after each one
    recorded (`RecurrentCache.start_trace`), on a cache as `applies` asks."""
    return 1 < x.shape[1] < CHUNKED_MIN_TOKENS and cache is not None and cache.trace is not None and _plain(mask, cache)


def scan_applies(x: mx.array, cache, most: int) -> bool:
    """A prompt chunk of 2 to `most` tokens the scan kernel takes: nothing recorded, no block snapshots, no
    left padding (right-padded batch rows stop at their lengths)."""
    return (
        1 < x.shape[1] <= most
        and cache is not None
        and cache.trace is None
        and cache.marks is None
        and (cache.left_padding is None or max(cache.left_padding) <= 0)
    )


def _plain(mask, cache) -> bool:
    """No mask, no batch lengths, no block snapshots, both states there."""
    return (
        mask is None and cache.lengths is None and cache.marks is None and cache[0] is not None and cache[1] is not None
    )


@cache
def _core(hk: int, hv: int, dk: int, dv: int, norm_eps: float):
    key_dim = hk * dk

    def core(qkv, z, a, b, conv_state, state, conv_w, A_log, dt_bias, norm_w):
        batch = qkv.shape[0]
        z = z.reshape(batch, 1, hv, dv)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K, C]
        # the conv's products summed in float32 and rounded once, as the layer's conv1d does
        conv = nn.silu(
            (conv_input.astype(mx.float32) * conv_w[:, :, 0].T.astype(mx.float32)).sum(axis=1).astype(qkv.dtype)
        )
        q = conv[:, :key_dim].reshape(batch, 1, hk, dk)
        k = conv[:, key_dim : 2 * key_dim].reshape(batch, 1, hk, dk)
        v = conv[:, 2 * key_dim :].reshape(batch, hv, dv)
        q, k = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
        q, k = repeat_heads(q, k, hv)
        g = decay(A_log, a, dt_bias)[:, 0]
        y, new_state = delta_step(q[:, 0], k[:, 0], v, g, mx.sigmoid(b)[:, 0], state)
        out = precise_swiglu(y, z[:, 0], mx.fast.rms_norm(y, norm_w, norm_eps))
        return out.reshape(batch, 1, hv * dv), conv_input[:, 1:, :], kept_as(new_state, state.dtype)

    return mx.compile(core)


def step_kernel_applies(layer) -> bool:
    """Whether the step may run the kernel: head sizes it takes, and a bf16 layer (the kernel rounds to bf16
    where the compiled core does for bf16 inputs; a float32 layer's core rounds nowhere)."""
    lin = layer.linear_attn
    return lin.conv1d.weight.dtype == mx.bfloat16 and gated_delta_step.refusal(lin.head_k_dim, lin.head_v_dim) is None


def layer_step(
    layer,
    fusion: Fusion,
    kernel: bool = False,
    link: LayerLink | None = None,
    prefill: bool = False,
    scan_tokens: int = 0,
) -> Callable[[mx.array, mx.array | None, Any], mx.array | None]:
    """A DeltaNet decoder layer's whole decode step as one compiled call: the input norm, the input
    projections (one launch in the fast tier), the core above, the output projection, the residual, the
    MLP and its residual, with `fusion`'s stages in the GEMV launches. Returns `step(x, mask, cache)`: the
    layer's output for one token, updating `cache` as the layer does, or None where the step does not
    apply (the layer's own path runs). `kernel`: the core is gated_delta_step's CUDA kernel (CUDA only; see
    `step_kernel_applies`). `link`: with `fusion.norm_out`, the input norm comes from the layer before and
    the next layer's from this step's last launch (`norm_handoff`). `prefill`: a prompt chunk runs as compiled
    calls too (`gated_delta_prefill`). `scan_tokens`: with `kernel`, a verify window or a prompt chunk of
    up to this many tokens runs its core as one launch of gated_delta_scan's kernel (0: off; a chunk then
    runs the layer's own parts around it, the window its compiled ones).

    The layer's weights are read when the step is first traced and held by the compiled graph (no
    copies), so `engine.kernels.install` makes a new step each time it changes the layer."""
    lin, link = layer.linear_attn, link or LayerLink()
    if kernel:
        core = partial(gated_delta_step.delta_step, norm_eps=lin.norm.eps, heads_k=lin.num_k_heads, dk=lin.head_k_dim)
    else:
        core = _core(lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim, lin.norm.eps)

    inputs = [lin.in_proj_qkv, lin.in_proj_z, lin.in_proj_b, lin.in_proj_a]  # input_projections' order

    def body(x, conv_state, state, *prenormed):
        # prenormed: () or the input norm's parts from the layer before (traced apart: another input count)
        qkv, z, beta_logits, a = normed_projections(
            x, layer.input_layernorm, inputs, fusion, prenormed
        )  # z [B, 1, Hv * Dv]
        out, conv_state, state = core(
            qkv, z, a, beta_logits, conv_state, state, lin.conv1d.weight, lin.A_log, lin.dt_bias, lin.norm.weight
        )
        return conv_state, state, *residual_mlp(layer, out, lin.out_proj, x, fusion, link.next_norm)

    def window(x, conv_state, state, *prenormed):
        # a verify window: the projections and the MLP over all its tokens (one launch each, every token's
        # rows), the core token after token as in a decode step; returns the conv input [tail; window] and the
        # state after each token for the trace
        qkv, z, beta_logits, a = normed_projections(x, layer.input_layernorm, inputs, fusion, prenormed)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        outs, states = [], []
        for t in range(x.shape[1]):
            out, conv_state, state = core(
                qkv[:, t : t + 1],
                z[:, t : t + 1],
                a[:, t : t + 1],
                beta_logits[:, t : t + 1],
                conv_state,
                state,
                lin.conv1d.weight,
                lin.A_log,
                lin.dt_bias,
                lin.norm.weight,
            )
            outs.append(out)
            states.append(state)
        outputs = residual_mlp(layer, mx.concatenate(outs, axis=1), lin.out_proj, x, fusion, link.next_norm)
        return conv_input, conv_state, *states, *outputs

    scan = kernel and scan_tokens > 1 and gated_delta_scan.refusal(lin.head_k_dim, lin.head_v_dim) is None
    core_scan = partial(gated_delta_scan.delta_scan, norm_eps=lin.norm.eps, heads_k=lin.num_k_heads, dk=lin.head_k_dim)
    weights = (lin.conv1d.weight, lin.A_log, lin.dt_bias, lin.norm.weight)

    def scan_window(x, conv_state, state, *prenormed):
        # `window` with its core as one launch: the same tokens, states and conv input, bit for bit
        qkv, z, beta_logits, a = normed_projections(x, layer.input_layernorm, inputs, fusion, prenormed)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        out, conv_state, _, states = core_scan(qkv, z, a, beta_logits, conv_state, state, *weights, trace=True)
        outputs = residual_mlp(layer, out, lin.out_proj, x, fusion, link.next_norm)
        return conv_input, conv_state, *[states[t] for t in range(x.shape[1])], *outputs

    def scan_chunk(x, cache) -> mx.array:
        # a prompt chunk: the layer's own parts around one launch of the core; rows stop at their lengths
        b, n = x.shape[:2]
        qkv, z, beta_logits, a = lin.input_projections(layer.input_layernorm(x))
        conv_state, state = cache[0], cache[1]
        if conv_state is None:
            conv_state = mx.zeros((b, lin.conv_kernel_size - 1, lin.conv_dim), dtype=qkv.dtype)
        if state is None:
            state = mx.zeros((b, lin.num_v_heads, lin.head_v_dim, lin.head_k_dim), dtype=lin.state_dtype)
        ends = None if cache.lengths is None else mx.clip(mx.array(cache.lengths), 0, n)
        out, cache[0], cache[1], _ = core_scan(qkv, z, a, beta_logits, conv_state, state, *weights, ends=ends)
        h = x + lin.out_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    compiled, compiled_window, compiled_scan_window = mx.compile(body), mx.compile(window), mx.compile(scan_window)
    chunk = gated_delta_prefill.layer_prefill(layer, fusion, link) if prefill else None

    def step(x: mx.array, mask, cache) -> mx.array | None:
        n = x.shape[1]
        if applies(x, mask, cache):
            cache[0], cache[1], *outputs = compiled(x, cache[0], cache[1], *link.take(x))
        elif window_applies(x, mask, cache):
            run = compiled_scan_window if scan and n <= scan_tokens else compiled_window
            conv_input, cache[0], *rest = run(x, cache[0], cache[1], *link.take(x))
            states, outputs = rest[:n], rest[n:]
            cache[1] = states[-1]
            cache.trace.record_conv(conv_input, n)
            cache.trace.states.extend(states)
        elif scan and scan_applies(x, cache, scan_tokens):
            h = scan_chunk(x, cache)
            cache.advance(n)
            return h
        else:
            return chunk(x, mask, cache) if chunk is not None else None
        cache.advance(n)
        return link.pass_on(tuple(outputs))

    return step
