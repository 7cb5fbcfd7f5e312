"""A decoder layer's parts as the fast tier's GEMV launches: which norms, SwiGLUs and residual adds ride
in which launch (`quantized_gemv.Fusion`), as `quantized_gemv.FUSE` asks, where the kernel takes the layers
(`quantized_gemv.one_launch`); elsewhere each part runs as its own operations. The fast tier's decode steps
(`gated_delta_decode`, `attention_decode`) build their layers from these.

The launches, the stages and FUSE are looked up in `quantized_gemv` at each call, so setting
`quantized_gemv.FUSE` (diagnostics, tests) or replacing its launch (tests) reaches these functions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import quantized_gemv as qg
from engine.models.activations import swiglu
from engine.models.base import project


def _fusable_norm(norm: nn.Module) -> bool:
    """A norm a launch can take (`Fusion.norm`, `Fusion.norm_scale`): RMS with a bf16 weight."""
    return isinstance(norm, nn.RMSNorm) and norm.weight.dtype == mx.bfloat16


def normed_projections(x: mx.array, norm: nn.Module, layers: Sequence[nn.Module],
                       prenormed: tuple[mx.array, ...] = ()) -> tuple[mx.array, ...]:  # fmt: skip
    """Each layer applied to `norm(x)`: with `prenormed` (x times the norm's weight and the parts of x's sums of
    squares, from the launch that made x: `Fusion.norm_out`), one launch that scales its sums by the norm
    (`Fusion.prenormed`) where the kernel takes the layers; with FUSE.norm or FUSE.norm_scale, one launch for
    the RMS norm and all the layers where the kernel takes them; otherwise the norm, then the layers as
    `project` runs them."""
    if prenormed and _fusable_norm(norm) and qg.one_launch(prenormed[0], layers) and qg.no_bias(layers):
        return qg.run_kernel(prenormed[0], layers, prenormed=(prenormed[1], norm.eps))
    fuse = qg.FUSE
    if (fuse.norm or fuse.norm_scale) and _fusable_norm(norm) and qg.one_launch(x, layers) and qg.no_bias(layers):
        return qg.run_kernel(x, layers, norm=(norm.weight, norm.eps), norm_scale=not fuse.norm)
    return project(norm(x), *layers)


def residual_projection(x: mx.array, layer: nn.Module, residual: mx.array) -> mx.array:
    """`residual + layer(x)`; with FUSE.residual one launch where the kernel takes it."""
    if _residual_launch(x, layer, residual):
        return qg.run_kernel(x, [layer], residual=residual)[0]
    return residual + layer(x)


def _takes_residual(x: mx.array, layer: nn.Module, residual: mx.array) -> bool:
    """Whether one launch can give `residual + layer(x)` (`Fusion.residual`), stages on its input aside."""
    return residual.dtype == mx.bfloat16 and qg.one_launch(x, [layer]) and qg.no_bias([layer])


def _residual_launch(x: mx.array, layer: nn.Module, residual: mx.array) -> bool:
    """Whether `residual + layer(x)` is one launch (FUSE.residual, `Fusion.residual`)."""
    return qg.FUSE.residual and _takes_residual(x, layer, residual)


def swiglu_projection(gate: mx.array, up: mx.array, layer: nn.Module, residual: mx.array) -> mx.array:
    """`residual + layer(silu(gate) * up)` (an MLP's down projection and its residual); with FUSE.swiglu one
    launch where the kernel takes it (`Fusion.swiglu` and `Fusion.residual`)."""
    if qg.FUSE.swiglu and up.dtype == gate.dtype and _takes_residual(gate, layer, residual):
        return qg.run_kernel(gate, [layer], up=up, residual=residual)[0]
    return residual_projection(swiglu(gate, up), layer, residual)


def mlp_half(layer: nn.Module, h: mx.array) -> mx.array:
    """A decoder layer's second half, `h + layer.mlp(layer.post_attention_layernorm(h))`, for an MLP of
    gate, up and down projections (SwiGLU). With FUSE.gated the gate and up launch gives the SwiGLU
    itself (`Fusion.gated`), and with FUSE.norm_scale the norm too: the norm, that launch, then the down
    projection (and its residual, with FUSE.residual) where the kernel takes them."""
    mlp = layer.mlp
    if not _swiglu_mlp(mlp):
        return h + mlp(layer.post_attention_layernorm(h))
    pair, norm = _gated_pair(mlp, h), layer.post_attention_layernorm
    if pair:
        if qg.FUSE.norm_scale and _fusable_norm(norm):
            act = qg.run_kernel(h, pair, norm=(norm.weight, norm.eps), gated=True, norm_scale=True)[0]
        else:
            act = qg.run_kernel(norm(h), pair, gated=True)[0]
        return residual_projection(act, mlp.down_proj, h)
    gate, up = normed_projections(h, norm, [mlp.gate_proj, mlp.up_proj])
    return swiglu_projection(gate, up, mlp.down_proj, h)


def residual_mlp(layer: nn.Module, out: mx.array, proj: nn.Module, x: mx.array,
                 next_norm: Optional[nn.Module] = None) -> tuple[mx.array, ...]:  # fmt: skip
    """A decoder layer's output projection, its residual and its second half:
    `(mlp_half(layer, residual_projection(out, proj, x)),)`. With FUSE.norm_out (and FUSE.residual,
    FUSE.gated) the projection's launch also takes the MLP's norm for the gate+up launch (`Fusion.norm_out`,
    `Fusion.prenormed`): no RMS norm launch between them, and no norm work in the gate+up launch's loop; and
    the down launch takes `next_norm` (the next layer's input norm) the same way, for the next layer's input
    projections (`normed_projections`' prenormed): then the result is (h, h * its weight, the parts)."""
    norm = layer.post_attention_layernorm
    if qg.FUSE.norm_out and _swiglu_mlp(layer.mlp) and _fusable_norm(norm) and _residual_launch(out, proj, x):
        pair = _gated_pair(layer.mlp, x)
        if pair:
            h, hw, ssq = qg.run_kernel(out, [proj], residual=x, norm_out=norm.weight)  # the launch checked above
            act = qg.run_kernel(hw, pair, gated=True, prenormed=(ssq, norm.eps))[0]
            if next_norm is not None and _fusable_norm(next_norm):
                return _residual_norm_out(act, layer.mlp.down_proj, h, next_norm)
            return (residual_projection(act, layer.mlp.down_proj, h),)
    return (mlp_half(layer, residual_projection(out, proj, x)),)


def _residual_norm_out(x: mx.array, layer: nn.Module, residual: mx.array, norm: nn.Module) -> tuple[mx.array, ...]:
    """`residual + layer(x)` as h, with h times the norm's weight and the launch blocks' parts of the sums of
    squares of h (`Fusion.norm_out`), where one launch takes the residual; else (h,)."""
    if _residual_launch(x, layer, residual):
        return qg.run_kernel(x, [layer], residual=residual, norm_out=norm.weight)
    return (residual_projection(x, layer, residual),)


def _swiglu_mlp(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))


def _gated_pair(mlp: nn.Module, h: mx.array) -> Optional[list[nn.Module]]:
    """The MLP's gate and up projections where one launch gives their SwiGLU (FUSE.gated), else None."""
    pair = [mlp.gate_proj, mlp.up_proj]
    same_shape = pair[0]["weight"].shape == pair[1]["weight"].shape
    if qg.FUSE.gated and same_shape and qg.one_launch(h, pair) and qg.no_bias(pair):
        return pair
    return None
