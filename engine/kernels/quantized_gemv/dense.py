"""A GEMV launch computed as GEMMs on the layers' kept dense copies, its fused stages as MLX operations.

`run_kernel`'s results, to rounding: each product is one matrix multiply (cuBLAS on CUDA) of x with the layer's
dequantized bf16 copy (`KernelQuantizedLinear.kept`, kept.py), then the stages the launch asks for, in the order
the kernel runs them (`Fusion`): the norm's row scale (`prenormed`, `norm_scale`), SwiGLU (`gated`), the
residual add, then norm_out's two results (the output times the next norm's weight and each row's sum of
squares, as one part a row). The weights are read in 16 bits instead of 4, so this pays only where the staged
kernel is bound by its products rather than by the bytes it reads: from `KernelConfig.dense_decode_rows`
(docs/kernels.md, "Dense copies for many rows").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.quantized_gemv.calls import batch_rows, norm_eps, stage_arrays, stage_inputs, with_bias
from engine.kernels.quantized_gemv.fusion import Fusion
from engine.kernels.quantized_gemv.layer import Launch


def stages(
    x: mx.array,
    ys: Sequence[mx.array],
    residual: mx.array | None = None,
    gated: bool = False,
    norm_out: mx.array | None = None,
    prenormed: tuple[mx.array, float] | None = None,
) -> tuple[mx.array, ...]:
    """A launch's results from its bare products `ys` of x (each [..., N_i]), as `quantized_matmuls` states its
    stages: rows scaled by rsqrt(sum of the prenormed parts / K + eps), silu(gate) * up, the residual added, then
    norm_out's output times its weight and each row's sum of squares ([M, 1] float32: one part a row)."""
    f32 = mx.float32
    ys = list(ys)
    if prenormed is not None:
        r = mx.rsqrt(prenormed[0].sum(axis=-1) / x.shape[-1] + prenormed[1]).reshape(*x.shape[:-1], 1)
        ys = [(y.astype(f32) * r).astype(y.dtype) for y in ys]
    if gated:
        ys = [nn.silu(ys[0]) * ys[1]]
    if residual is not None:
        ys = [residual + ys[0]]
    if norm_out is not None:
        h = ys[0]
        ssq = (h.astype(f32) ** 2).reshape(-1, h.shape[-1]).sum(axis=-1, keepdims=True)
        ys += [(h.astype(f32) * norm_out.astype(f32)).astype(h.dtype), ssq]
    return tuple(ys)


@cache
def _compiled(count: int, fusion: Fusion, eps: float):
    # traced once per input shape, as the kernel's launches are: a decode step does not rebuild the operations
    def run(x, *arrays):
        norm, residual, norm_out, prenormed = stage_inputs(arrays[count:], fusion, eps)
        if norm is not None:
            x = mx.fast.rms_norm(x, *norm)
        return stages(x, [x @ w.T for w in arrays[:count]], residual, fusion.gated, norm_out, prenormed)

    return mx.compile(run)


def dense_launch(
    x: mx.array,
    layers: Sequence[nn.QuantizedLinear],
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
    gated: bool = False,
    norm_scale: bool = False,
    norm_out: mx.array | None = None,
    prenormed: tuple[mx.array, float] | None = None,
) -> tuple[mx.array, ...]:
    """`run_kernel(x, layers, ...)` on the layers' kept dense copies (every layer has one), biases added."""
    fusion = Fusion.of(residual, gated, norm_scale, norm_out, prenormed)
    run = _compiled(len(layers), fusion, norm_eps(norm, prenormed))
    ys = run(x, *(q.kept.weight for q in layers), *stage_arrays(norm, residual, norm_out, prenormed))
    return tuple(with_bias(y, q) for y, q in zip(ys, layers)) + tuple(ys[len(layers) :])


def takes(x: mx.array, layers: Sequence[nn.QuantizedLinear], rows: int) -> bool:
    """Whether a launch of x runs as `dense_launch`: every layer keeps a dense copy and x's batch has at least `rows`
    rows (0: never). The batch's rows, not the launch's (`calls.batch_rows`, as the staged kernel's rounding rule
    counts them): a verify window of W tokens over B rows takes the arithmetic of B-row steps (cuBLAS may still
    order a B x W-row product's sums otherwise than a B-row one's, so there greedy speculation agrees with plain
    decoding to rounding, not bit for bit)."""
    return 0 < rows <= batch_rows(x) and all(getattr(q, "kept", None) is not None for q in layers)


def preferring_dense(launch: Launch, rows: int) -> Launch:
    """`launch`, except for the launches of batches of `rows` rows and more that `takes` gives to `dense_launch`."""

    def run(x: mx.array, layers: Sequence[nn.QuantizedLinear], **stages) -> tuple[mx.array, ...]:
        return dense_launch(x, layers, **stages) if takes(x, layers, rows) else launch(x, layers, **stages)

    return run
