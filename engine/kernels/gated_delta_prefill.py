"""A Gated DeltaNet decoder layer's prompt chunk as two compiled calls around the delta rule.

A prompt chunk's forward costs the host every graph node it builds and
submits, whatever the chunk's length: a DeltaNet layer's prompt path is
~130 operations (the norms, the projections, the conv, the chunked rule's
products and the gates between them, the gated norm, the MLP), so a
64-layer hybrid's forward is thousands before its first token. Here what
comes before the rule (the input norm and projections, the conv, the q/k
norms) is one compiled call and what comes after it (the gated norm, the
output projection, the MLP and the residuals) another, each traced once per
chunk shape and batch mask, so the host replays their graphs and MLX fuses
their elementwise chains. The rule runs between them as the layer runs it
(`GatedDeltaNet.rule`), so the block snapshots it keeps at any token count
make no new trace. The layer's own stages run inside (`conv_heads`,
`gated_norm`, the GEMV launches of `layer_launches` with `fusion`'s stages
where a chunk has few enough rows): the fast tier, equal to the layer's path
to rounding.
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
    def before(present: tuple[str, ...]):
        # present: which of conv, mask, ends the call passes
        def run(x, arrays, *prenormed):
            qkv, z, beta_logits, a = normed_projections(x, layer.input_layernorm, inputs, fusion, prenormed)
            get = arrays.get
            return *lin.conv_heads(qkv, get("conv"), get("mask"), get("ends")), z, beta_logits, a

        return mx.compile(run)

    def after_run(x, y, z):
        return residual_mlp(layer, lin.gated_norm(y, z), lin.out_proj, x, fusion, link.next_norm)

    after = mx.compile(after_run)

    def prefill(x: mx.array, mask, cache) -> mx.array | None:
        if not applies(x, cache):
            return None
        s = x.shape[1]
        ends = None if cache.lengths is None else mx.clip(mx.array(cache.lengths), 0, s)
        named = {"conv": cache[0], "mask": mask, "ends": ends}
        arrays = {k: v for k, v in named.items() if v is not None}
        q, k, v, conv_input, cache[0], z, beta_logits, a = before(tuple(arrays))(x, arrays, *link.take(x))
        marks = cache.marks
        y, cache[1] = lin.rule(q, k, v, a, beta_logits, cache[1], mask, marks=marks.states if marks else None)
        if marks is not None:
            marks.conv_input = conv_input
        cache.advance(s)
        return link.pass_on(tuple(after(x, y, z)))

    return prefill
