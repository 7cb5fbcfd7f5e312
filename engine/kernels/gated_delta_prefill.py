"""A Gated DeltaNet decoder layer's prompt chunk as one compiled call.

A prompt chunk's forward costs the host every graph node it builds and
submits, whatever the chunk's length: a DeltaNet layer's prompt path is
~140 operations (the norms, the projections, the conv, the chunked rule's
products and the gates between them, the gated norm, the MLP), so a
64-layer hybrid's forward is thousands before its first token. Compiled as
one call per layer (traced once per chunk shape, batch mask and block
snapshot counts), the host replays the graph and MLX fuses its elementwise
chains. The layer's own stages run inside (`GatedDeltaNet.mix`, the GEMV
launches of `layer_launches` with `fusion`'s stages where a chunk has few
enough rows), so this is the fast tier: equal to the layer's path to
rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import mlx.core as mx

from engine.kernels.layer_launches import normed_projections, residual_mlp
from engine.kernels.norm_handoff import LayerLink
from engine.kernels.quantized_gemv import Fusion
from engine.models.gated_delta import CHUNKED_MIN_TOKENS


def applies(x: mx.array, cache) -> bool:
    """A prompt chunk (as many tokens as the chunked rule takes) into a cache that records no trace."""
    return x.shape[1] >= CHUNKED_MIN_TOKENS and cache is not None and cache.trace is None


def layer_prefill(
    layer, fusion: Fusion, link: LayerLink | None = None
) -> Callable[[mx.array, mx.array | None, Any], mx.array | None]:
    """`prefill(x, mask, cache)`: the DeltaNet decoder layer's output for a prompt chunk, updating `cache`
    (and filling its block snapshots' marks) as the layer does, or None where it does not apply. The
    weights are held by the compiled graphs from their first trace, so `engine.kernels.install` makes a
    new one each time it changes the layer."""
    lin, link = layer.linear_attn, link or LayerLink()
    inputs = [lin.in_proj_qkv, lin.in_proj_z, lin.in_proj_b, lin.in_proj_a]  # input_projections' order

    @cache
    def compiled(present: tuple[str, ...], counts: tuple[int, ...]):
        # present: which of conv, state, mask, ends the call passes; counts: the marks' token counts
        def body(x, arrays, *prenormed):
            qkv, z, beta_logits, a = normed_projections(x, layer.input_layernorm, inputs, fusion, prenormed)
            marks = dict.fromkeys(counts) if counts else None
            get = arrays.get
            out, conv_input, conv_state, state = lin.mix(
                qkv, z, beta_logits, a, get("conv"), get("state"), get("mask"), get("ends"), marks=marks
            )
            outputs = residual_mlp(layer, out, lin.out_proj, x, fusion, link.next_norm)
            kept = (conv_input, *(marks[n] for n in counts)) if counts else ()
            return conv_state, state, *kept, *outputs

        return mx.compile(body)

    def prefill(x: mx.array, mask, cache) -> mx.array | None:
        if not applies(x, cache):
            return None
        s = x.shape[1]
        ends = None if cache.lengths is None else mx.clip(mx.array(cache.lengths), 0, s)
        named = {"conv": cache[0], "state": cache[1], "mask": mask, "ends": ends}
        arrays = {k: v for k, v in named.items() if v is not None}
        counts = tuple(sorted(cache.marks.states)) if cache.marks is not None else ()
        cache[0], cache[1], *rest = compiled(tuple(arrays), counts)(x, arrays, *link.take(x))
        if counts:
            cache.marks.conv_input, *states = rest[: len(counts) + 1]
            cache.marks.states.update(zip(counts, states))
            rest = rest[len(counts) + 1 :]
        cache.advance(s)
        return link.pass_on(tuple(rest))

    return prefill
