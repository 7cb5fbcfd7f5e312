"""A decoder layer's parts as the fast tier's GEMV launches: which norms, SwiGLUs and residual adds ride
in which launch, as the `Fusion` a step is built with asks, where the kernel takes the layers
(`quantized_gemv.one_launch`); elsewhere each part runs as its own operations. The fast tier's decode steps
(`gated_delta_decode`, `attention_decode`) build their layers from these. A launch is computed by its first
layer's `launch` (`KernelQuantizedLinear`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.quantized_gemv import Fusion, no_bias, one_launch
from engine.models.activations import swiglu
from engine.models.base import project


def _launch(x: mx.array, layers: Sequence[nn.Module], **stages) -> tuple[mx.array, ...]:
    return layers[0].launch(x, layers, **stages)


def _fusable_norm(norm: nn.Module) -> bool:
    """A norm a launch can take (`Fusion.norm_scale`, `Fusion.prenormed`): RMS with a bf16 weight."""
    return isinstance(norm, nn.RMSNorm) and norm.weight.dtype == mx.bfloat16


def normed_projections(
    x: mx.array, norm: nn.Module, layers: Sequence[nn.Module], fusion: Fusion, prenormed: tuple[mx.array, ...] = ()
) -> tuple[mx.array, ...]:
    """Each layer applied to `norm(x)`: with `prenormed` (x times the norm's weight and the parts of x's sums of
    squares, from the launch that made x: `Fusion.norm_out`), one launch that scales its sums by the norm
    (`Fusion.prenormed`) where the kernel takes the layers; with `fusion.norm_scale`, one launch for the RMS
    norm and all the layers where the kernel takes them; otherwise the norm, then the layers as `project`
    runs them."""
    if prenormed and _fusable_norm(norm) and one_launch(prenormed[0], layers) and no_bias(layers):
        return _launch(prenormed[0], layers, prenormed=(prenormed[1], norm.eps))
    if fusion.norm_scale and _fusable_norm(norm) and one_launch(x, layers) and no_bias(layers):
        return _launch(x, layers, norm=(norm.weight, norm.eps), norm_scale=True)
    return project(norm(x), *layers)


def residual_projection(x: mx.array, layer: nn.Module, residual: mx.array, fusion: Fusion) -> mx.array:
    """`residual + layer(x)`; with `fusion.residual` one launch where the kernel takes it."""
    if _residual_launch(x, layer, residual, fusion):
        return _launch(x, [layer], residual=residual)[0]
    return residual + layer(x)


def _residual_launch(x: mx.array, layer: nn.Module, residual: mx.array, fusion: Fusion) -> bool:
    """Whether `residual + layer(x)` is one launch (`Fusion.residual`)."""
    return fusion.residual and residual.dtype == mx.bfloat16 and one_launch(x, [layer]) and no_bias([layer])


def mlp_half(layer: nn.Module, h: mx.array, fusion: Fusion) -> mx.array:
    """A decoder layer's second half, `h + layer.mlp(layer.post_attention_layernorm(h))`, for an MLP of
    gate, up and down projections (SwiGLU). With `fusion.gated` the gate and up launch gives the SwiGLU
    itself (`Fusion.gated`), and with `fusion.norm_scale` the norm too: the norm, that launch, then the down
    projection (and its residual, with `fusion.residual`) where the kernel takes them."""
    mlp = layer.mlp
    if not _swiglu_mlp(mlp):
        return h + mlp(layer.post_attention_layernorm(h))
    pair, norm = _gated_pair(mlp, h, fusion), layer.post_attention_layernorm
    if pair:
        if fusion.norm_scale and _fusable_norm(norm):
            act = _launch(h, pair, norm=(norm.weight, norm.eps), gated=True, norm_scale=True)[0]
        else:
            act = _launch(norm(h), pair, gated=True)[0]
        return residual_projection(act, mlp.down_proj, h, fusion)
    gate, up = normed_projections(h, norm, [mlp.gate_proj, mlp.up_proj], fusion)
    return residual_projection(swiglu(gate, up), mlp.down_proj, h, fusion)


def residual_mlp(
    layer: nn.Module, out: mx.array, proj: nn.Module, x: mx.array, fusion: Fusion, next_norm: nn.Module | None = None
) -> tuple[mx.array, ...]:
    """A decoder layer's output projection, its residual and its second half:
    `(mlp_half(layer, residual_projection(out, proj, x)),)`. With `fusion.norm_out` (and residual, gated)
    the projection's launch also takes the MLP's norm for the gate+up launch (`Fusion.norm_out`,
    `Fusion.prenormed`): no RMS norm launch between them, and no norm work in the gate+up launch's loop; and
    the down launch takes `next_norm` (the next layer's input norm) the same way, for the next layer's input
    projections (`normed_projections`' prenormed): then the result is (h, h * its weight, the parts)."""
    norm = layer.post_attention_layernorm
    if fusion.norm_out and _swiglu_mlp(layer.mlp) and _fusable_norm(norm) and _residual_launch(out, proj, x, fusion):
        pair = _gated_pair(layer.mlp, x, fusion)
        if pair:
            h, hw, ssq = _launch(out, [proj], residual=x, norm_out=norm.weight)  # the launch checked above
            act = _launch(hw, pair, gated=True, prenormed=(ssq, norm.eps))[0]
            if next_norm is not None and _fusable_norm(next_norm):
                return _residual_norm_out(act, layer.mlp.down_proj, h, next_norm, fusion)
            return (residual_projection(act, layer.mlp.down_proj, h, fusion),)
    return (mlp_half(layer, residual_projection(out, proj, x, fusion), fusion),)


def _residual_norm_out(
    x: mx.array, layer: nn.Module, residual: mx.array, norm: nn.Module, fusion: Fusion
) -> tuple[mx.array, ...]:
    """`residual + layer(x)` as h, with h times the norm's weight and the launch blocks' parts of the sums of
    squares of h (`Fusion.norm_out`), where one launch takes the residual; else (h,)."""
    if _residual_launch(x, layer, residual, fusion):
        return _launch(x, [layer], residual=residual, norm_out=norm.weight)
    return (residual_projection(x, layer, residual, fusion),)


def _swiglu_mlp(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))


def _gated_pair(mlp: nn.Module, h: mx.array, fusion: Fusion) -> list[nn.Module] | None:
    """The MLP's gate and up projections where one launch gives their SwiGLU (`fusion.gated`), else None."""
    pair = [mlp.gate_proj, mlp.up_proj]
    same_shape = pair[0]["weight"].shape == pair[1]["weight"].shape
    if fusion.gated and same_shape and one_launch(h, pair) and no_bias(pair):
        return pair
    return None
