"""A Qwen3.5 full-attention decoder layer's decode step (one token a row, or a verify window of a few) as two
compiled calls.

What a token does in such a layer before and after the attention itself has
fixed shapes every step: the input norm, the q/k/v projections (one launch in
the fast tier), the q/k norms and the gate split; then the output gate, the
output projection, the residual, the MLP and its residual. Each part is
compiled once per batch size, so the host replays two graphs instead of
building ~25 operations in Python, and MLX fuses the elementwise ones.
Between them the layer's own `Attention.attend` runs unchanged (rope at the
cache's offset, the cache update, attention), so any cache the layer takes,
serial or batched, works here too.

With `attention_step`'s kernels (CUDA; a plain serial cache or the continuous
batcher's left-padded one) the step is also two compiled calls: the
projections and the new k and v, then the attention, the output projection
and the MLP, with the cache's update between them and each row's positions
passed in as arrays, so both replay at every position.

With `KernelConfig.compiled_prefill` a prompt chunk runs the same two compiled
parts around the layer's own attention (one trace per chunk shape).

Fusion keeps float32 intermediates where the layer's graph rounds, so this is
the fast tier: equal to the layer's step up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx

from engine.cache.batch_kv import BatchKVCache
from engine.cache.kv import KVCache
from engine.kernels import attention_step
from engine.kernels.layer_launches import normed_projections, residual_mlp
from engine.kernels.norm_handoff import LayerLink
from engine.kernels.quantized_gemv import Fusion
from engine.models.gated_delta import CHUNKED_MIN_TOKENS


def applies(layer) -> bool:
    """A layer whose attention has the stages the step compiles around (Qwen3.5's gated attention)."""
    attn = getattr(layer, "self_attn", None)
    return all(hasattr(attn, stage) for stage in ("heads", "attend", "gated"))


def kernel_applies(layer) -> bool:
    """Whether the layer's attention can run `attention_step`'s CUDA kernels here (for a bf16 token and a
    plain KV cache; the step checks those each call)."""
    from engine.kernels import on_cuda  # the package imports this module before it defines on_cuda

    return on_cuda() and attention_step.refusal(layer.self_attn) is None


def layer_step(
    layer,
    fusion: Fusion,
    kernels: bool = False,
    link: LayerLink | None = None,
    prefill: bool = False,
    group_rows: int = 0,
) -> Callable[[mx.array, mx.array | None, Any], mx.array | None]:
    """`step(x, mask, cache)`: the layer's output for one token a row, or a few (a speculative verify window,
    up to CHUNKED_MIN_TOKENS - 1), updating `cache` as the layer does, or None for more tokens a row (the
    layer's own path runs; with `prefill` a prompt chunk takes the compiled parts around the layer's own
    attention, one trace per chunk shape). With `kernels` (CUDA only), one bf16 token with a plain `KVCache`
    and no mask, or with a `BatchKVCache` (whose mask only hides each row's left padding, which the kernels
    skip), takes `attention_step`'s kernels between the projections; a few bf16 tokens on either cache take
    them token after token (each token's attention over the columns before it: causal, as the window's mask
    says); anything else the compiled parts around the layer's own attention; `fusion`'s stages ride in the
    GEMV launches; from `group_rows` rows (0: never) `attend` takes a block per kv head for all its q heads.
    `link`: with `fusion.norm_out`, the input norm
    comes from the layer before and the next layer's from this step's last launch (`norm_handoff`). The
    weights are held by the compiled graphs from their first trace (no copies), so
    `engine.kernels.install` makes a new step each time it changes the layer."""
    attn, link = layer.self_attn, link or LayerLink()
    fpar = attention_step.float_params(attn) if kernels else None
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]

    # prenormed: () or the input norm's parts from the layer before
    def before(x, *prenormed):
        return attn.heads(*normed_projections(x, layer.input_layernorm, projections, fusion, prenormed))

    def after(x, out, gate):
        return residual_mlp(layer, attn.gated(out, gate), attn.o_proj, x, fusion, link.next_norm)

    before_c, after_c = mx.compile(before), mx.compile(after)

    def grouped(rows: int) -> bool:
        return 0 < group_rows <= rows

    # The kernel path in two compiled calls around the cache's update (whose slices move every step): the
    # positions go in as arrays (`row_params`, `attend_params`), so each call replays its graph at every
    # step; only the number of chunks `attend` splits the cache into (and the cache buffers' length, every
    # 256 positions) makes a new trace.
    def kernel_before(x, rpar, *prenormed):
        q, k, v = normed_projections(x, layer.input_layernorm, projections, fusion, prenormed)
        return (q, *attention_step.keys(attn, k, v, rpar, fpar))

    @cache
    def kernel_after(s: int):
        def run(x, q, keys_buf, values_buf, apar, rpar):
            out = attention_step.attend(attn, q, keys_buf, values_buf, apar, rpar, fpar, s, grouped(q.shape[0]))
            return residual_mlp(layer, out, attn.o_proj, x, fusion, link.next_norm)

        return mx.compile(run)

    kernel_before_c = mx.compile(kernel_before)

    def rows_at(cache, rows: int) -> mx.array:
        """`row_params` for the cache's next token: each row's first column and that token's position."""
        if type(cache) is KVCache:  # every row at the same position, from column 0
            return attention_step.row_params((0,) * rows, (cache.offset,) * rows)
        # BatchKVCache: row b holds columns [left_padding[b], idx), at position idx - left_padding[b]
        return attention_step.row_params(tuple(cache.left_padding), tuple(cache.offsets))

    def append(cache, k, v) -> tuple[int, tuple[mx.array, mx.array]]:
        """The new token's k and v into the cache: the columns it then holds and its buffers."""
        if type(cache) is KVCache:
            cache.append(k, v)
            return cache.offset, (cache.keys, cache.values)
        cache.update_and_fetch(k, v)  # its views of the columns go unused
        return cache.idx, tuple(cache.parts)

    def kernel_step(x: mx.array, cache, prenormed: tuple) -> tuple[mx.array, ...]:
        rpar = rows_at(cache, x.shape[0])
        q, k, v = kernel_before_c(x, rpar, *prenormed)
        n, buffers = append(cache, k, v)
        apar, s = attention_step.attend_params(n, buffers[0].shape[2])
        return tuple(kernel_after(s)(x, q, *buffers, apar, rpar))

    # A verify window through the kernels: the projections, the output projection and the MLP over all its
    # tokens (one launch each), each token's k, v and attention as a decode step's, one token after another,
    # so that a token's attention is the one it would have had decoded alone.
    def window_before(x, *prenormed):
        return normed_projections(x, layer.input_layernorm, projections, fusion, prenormed)

    def window_after(x, out):
        return residual_mlp(layer, out, attn.o_proj, x, fusion, link.next_norm)

    window_before_c, window_after_c = mx.compile(window_before), mx.compile(window_after)

    def kernel_window(x: mx.array, cache, prenormed: tuple) -> tuple[mx.array, ...]:
        q, k, v = window_before_c(x, *prenormed)
        outs = []
        for t in range(x.shape[1]):
            rpar = rows_at(cache, x.shape[0])
            n, buffers = append(cache, *attention_step.keys(attn, k[:, t : t + 1], v[:, t : t + 1], rpar, fpar))
            apar, s = attention_step.attend_params(n, buffers[0].shape[2])
            outs.append(
                attention_step.attend(attn, q[:, t : t + 1], *buffers, apar, rpar, fpar, s, grouped(x.shape[0]))
            )
        return tuple(window_after_c(x, mx.concatenate(outs, axis=1)))

    def step(x: mx.array, mask, cache) -> mx.array | None:
        window = x.shape[1] < CHUNKED_MIN_TOKENS
        if not (window or prefill):
            return None
        prenormed = link.take(x)
        kernel = kernels and window and x.dtype == mx.bfloat16
        if kernel and x.shape[1] == 1 and ((mask is None and type(cache) is KVCache) or type(cache) is BatchKVCache):
            return link.pass_on(kernel_step(x, cache, prenormed))
        if kernel and x.shape[1] > 1 and type(cache) in (KVCache, BatchKVCache):  # (each token sees those before)
            return link.pass_on(kernel_window(x, cache, prenormed))
        q, k, v, gate = before_c(x, *prenormed)
        return link.pass_on(tuple(after_c(x, attn.attend(q, k, v, mask, cache), gate)))

    return step
