"""The GEMV kernel's calls: x [..., K] bf16 times affine-quantized matrices, transposed.

`quantized_matmuls` checks what is asked, lays the launch out and calls the
kernel; `run_kernel` is the compiled form the model's layers call (traced once
per input shape, so a decode step does not rebuild the call on the host).
Results agree with MLX's quantized matmul to rounding, not bit for bit: the
kernel rounds nothing before its bf16 output, where MLX rounds the
dequantized weights to bf16.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.quantized_gemv import staged
from engine.kernels.quantized_gemv.fusion import Fusion
from engine.kernels.quantized_gemv.launch import LaunchConfig, Launches, launch_config
from engine.kernels.quantized_gemv.layouts import NO_LAYOUTS, StagedLayouts

MAX_ROWS = 64  # the kernel's limit
BITS = (4, 8)
GROUP_SIZES = (32, 64)

Matrices = Sequence[tuple[mx.array, mx.array, mx.array]]  # (weight, scales, biases) each


def weight_refusal(w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str = "affine") -> str | None:
    """Why the kernel cannot use these weights at all (None when it can)."""
    if mode != "affine":
        return f"mode {mode}"
    if bits not in BITS:
        return f"{bits}-bit weights"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size}"
    if scales.dtype != mx.bfloat16:
        return f"{scales.dtype} scales (bf16 only)"
    if w.ndim != 2:
        return "batched weights"
    if w.shape[1] * 32 // bits % 32:
        return f"input size {w.shape[1] * 32 // bits}"
    return None


def refusal(x: mx.array, w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str = "affine") -> str | None:
    """Why the kernel cannot compute this product (None when it can)."""
    why = weight_refusal(w, scales, group_size, bits, mode)
    if why:
        return why
    if x.dtype != mx.bfloat16:
        return f"{x.dtype} activations (bf16 only)"
    k = x.shape[-1]
    if w.shape[1] * 32 // bits != k:
        return f"input size {k}"
    m = x.size // k
    if m > MAX_ROWS:
        return f"{m} rows (at most {MAX_ROWS})"
    return None


def quantized_matmuls(
    x: mx.array,
    matrices: Matrices,
    group_size: int,
    bits: int,
    config: LaunchConfig | staged.StagedConfig | None = None,
    *,
    launches: Launches = {},
    layouts: StagedLayouts = NO_LAYOUTS,
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
    gated: bool = False,
    norm_scale: bool = False,
    norm_out: mx.array | None = None,
    prenormed: tuple[mx.array, float] | None = None,
) -> list[mx.array]:
    """x [..., K] bf16 times each quantized [N_i, K] matrix, transposed, in one launch: [..., N_i] bf16 each (CUDA
    only). Each result equals this call's for that matrix alone. `config` overrides `launch_config` (and `launches`, its
    one-row table) or `staged.staged_config` (and `layouts`, its changes by row count). In the same launch (`Fusion`),
    to rounding what the separate operations give: `residual` ([..., N], one matrix) is added to the product; `gated`
    (two matrices of equal rows, gate and up) gives one result, silu(gate product) * up product; `norm_scale` with
    `norm` (weight [K], eps) multiplies by the RMS norm of x, `mx.fast.rms_norm(x, weight, eps)`, taken after the
    products. `norm_out` (the next norm's weight [N], one matrix) adds two results for the launch that takes that norm:
    the result times the weight ([..., N] bf16) and the blocks' parts of each row's sum of squares ([M, blocks]
    float32); `prenormed` (those parts, the norm's eps) is that launch, x being the result times the weight: together,
    `norm=(weight, eps), norm_scale=True` on the first launch's result, to rounding."""
    k = x.shape[-1]
    m = x.size // k
    if norm_scale and norm is None:
        raise ValueError("norm_scale takes the norm's weight and eps (norm=)")
    if prenormed is not None and (
        norm is not None or prenormed[0].dtype != mx.float32 or prenormed[0].ndim != 2 or prenormed[0].shape[0] != m
    ):
        raise ValueError("prenormed takes float32 parts [M, blocks] of the sums of squares, and no norm")
    if norm is not None and not norm_scale:
        raise ValueError("a launch takes a norm after its products only (norm_scale=True)")
    fusion = Fusion.of(residual, gated, norm_scale, norm_out, prenormed)
    if (fusion.residual or fusion.norm_out) and len(matrices) != 1:
        raise ValueError("a residual or norm_out goes with one matrix")
    if norm_out is not None and norm_out.shape != (matrices[0][0].shape[0],):
        raise ValueError(f"norm_out: the next norm's weight is {norm_out.shape}, not one value a row")
    if gated:
        if len(matrices) != 2 or matrices[0][0].shape != matrices[1][0].shape or fusion.residual or fusion.norm_out:
            raise ValueError("a gated launch takes two matrices of one shape (gate, up) and no residual")
    # The kernel reads its inputs as flat rows and writes results of x's leading shape: no reshapes, which
    # would be graph nodes the host handles at every decode step.
    extra = stage_arrays(norm, residual, norm_out, prenormed)
    if isinstance(config, staged.StagedConfig) or (config is None and staged.takes(m, k, group_size, bits, fusion)):
        batch = batch_rows(x)
        config = config or staged.staged_config(m, k, group_size, bits, layouts, batch)
        template = fusion.prenormed * [("P", prenormed[0].shape[-1] if prenormed else 0)] + (
            fusion.norm_scale or fusion.prenormed
        ) * [("EPS", float_bits(norm_eps(norm, prenormed)))]
        return staged.matmuls(x, matrices, group_size, bits, config, fusion, extra, template)
    config = config or launch_config(m, k, group_size, bits, sum(w.shape[0] for w, _, _ in matrices), launches)
    if gated:
        config = replace(config, row_tiles=config.row_tiles + config.row_tiles % 2)  # tiles in pairs
    config = fitted(config, m, fusion)
    args = launch_arguments(
        x,
        matrices,
        group_size,
        bits,
        config,
        extra,
        fusion,
        prenormed[0].shape[-1] if prenormed else 0,
        norm_eps(norm, prenormed),
    )
    return config.kernel(len(matrices), fusion)(**args)


SHARED_BYTES = 40 << 10  # of the 48 KB of static shared memory a block may use; the rest for the stages' own


def fitted(config: LaunchConfig, m: int, fusion: Fusion) -> LaunchConfig:
    """`config` with fewer row groups where the sums' staging (and norm_out's squares) would take more than
    SHARED_BYTES of shared memory at M rows, and no split of the rows for norm_scale. Each row's sums run as
    before: neither splits a sum."""

    def staged(c: LaunchConfig) -> int:
        out_rows = 16 * c.row_tiles // (2 if fusion.gated else 1) * c.row_groups
        return 4 * (
            c.warps // c.m_groups * 16 * c.row_tiles * (8 * -(-m // 8) + 1) + fusion.norm_out * out_rows * (m + 1)
        )

    if fusion.norm_scale and config.m_groups > 1:  # its squares are gathered per warp of all rows
        config = replace(config, warps=config.warps // config.m_groups, m_groups=1)
    while config.row_groups > 1 and staged(config) > SHARED_BYTES:
        config = replace(config, warps=config.warps // 2, row_groups=config.row_groups // 2)
    return config


def float_bits(value: float) -> int:
    """A float32's bits as a signed int: how a kernel takes a constant float (`__int_as_float`) as a template
    value. As an input, a one-value array would live in MLX's CUDA pool for arrays of up to 8 bytes, managed
    memory the host also writes, and a kernel reading it can wait for its page (docs/kernels.md, "Kernel
    constants")."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def launch_arguments(
    x: mx.array,
    matrices: Matrices,
    group_size: int,
    bits: int,
    config: LaunchConfig,
    extra: Sequence[mx.array] = (),
    fusion: Fusion = Fusion(),
    parts: int = 0,
    eps: float = 0.0,
) -> dict:
    """The kernel call's arguments for x [..., K] (M rows in all) and the matrices, each result [..., N_i]:
    blocks matrix after matrix, matrix i's from block BLK{i}, one block per 16 * row_tiles * row_groups rows.
    A gated launch: one block per 16 * row_tiles * row_groups / 2 rows of both matrices, one result. norm_out: its two results
    after the product (`source.output_names`); prenormed: `parts` sums of squares a row in its input
    (template P). A norm's `eps` is a template value (EPS, its float32 bits), not an input: `float_bits`."""
    k = x.shape[-1]
    m = x.size // k
    rows = [w.shape[0] for w, _, _ in matrices]
    starts = [0]
    for n in rows[:1] if fusion.gated else rows:
        tile_rows = 16 * config.row_tiles * config.row_groups // (2 if fusion.gated else 1)
        starts.append(starts[-1] + (n + tile_rows - 1) // tile_rows)
    products = len(starts) - 1
    norm_out = fusion.norm_out * [(*x.shape[:-1], rows[0]), (m, starts[-1])]
    return dict(
        inputs=[x] + [a for triple in matrices for a in triple] + list(extra),
        template=[("K", k), ("M", m), ("BITS", bits), ("GS", group_size)]
        + config.template()
        + [(f"N{i}", n) for i, n in enumerate(rows)]
        + [(f"BLK{i}", b) for i, b in enumerate(starts[:-1])]
        + fusion.prenormed * [("P", parts)]
        + (fusion.norm_scale or fusion.prenormed) * [("EPS", float_bits(eps))],
        grid=(starts[-1] * config.warps * 32, 1, 1),
        threadgroup=(config.warps * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n) for n in rows[:products]] + norm_out,
        output_dtypes=[mx.bfloat16] * products + fusion.norm_out * [mx.bfloat16, mx.float32],
    )


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    config: LaunchConfig | None = None,
) -> mx.array:
    """x [..., K] bf16 times the quantized [N, K] matrix, transposed: [..., N] bf16 (CUDA only)."""
    return quantized_matmuls(x, [(w, scales, biases)], group_size, bits, config)[0]


@cache
def _compiled(
    group_size: int,
    bits: int,
    count: int = 1,
    fusion: Fusion = Fusion(),
    eps: float = 0.0,
    launches: frozenset = frozenset(),
    layouts: StagedLayouts = NO_LAYOUTS,
):
    # Traced once per input shape: later calls skip building the kernel call (template list, source text) on
    # the host, at hundreds of calls a decode step.
    table = dict(launches)

    def run(x, *arrays):
        triples = [arrays[i : i + 3] for i in range(0, 3 * count, 3)]
        norm, residual, norm_out, prenormed = stage_inputs(arrays[3 * count :], fusion, eps)
        return quantized_matmuls(
            x,
            triples,
            group_size,
            bits,
            launches=table,
            layouts=layouts,
            norm=norm,
            residual=residual,
            gated=fusion.gated,
            norm_scale=fusion.norm_scale,
            norm_out=norm_out,
            prenormed=prenormed,
        )

    return mx.compile(run)


def run_kernel(
    x: mx.array,
    layers: Sequence[nn.QuantizedLinear],
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
    gated: bool = False,
    norm_scale: bool = False,
    norm_out: mx.array | None = None,
    prenormed: tuple[mx.array, float] | None = None,
) -> tuple[mx.array, ...]:
    """The layers (same bits and group size) applied to x in one compiled launch, biases added (the fused
    stages take layers without bias), then norm_out's two results where asked. The one-row launch shapes
    and the staged layouts are the first layer's (`layer.KernelQuantizedLinear.launches`, `.layouts`)."""
    first = layers[0]
    arrays = [q[name] for q in layers for name in ("weight", "scales", "biases")]
    fusion = Fusion.of(residual, gated, norm_scale, norm_out, prenormed)
    extra = stage_arrays(norm, residual, norm_out, prenormed)  # eps is a constant of the trace
    launches = getattr(first, "launches", frozenset())
    layouts = getattr(first, "layouts", NO_LAYOUTS)
    run = _compiled(first.group_size, first.bits, len(layers), fusion, norm_eps(norm, prenormed), launches, layouts)
    ys = run(x, *arrays, *extra)
    return tuple(with_bias(y, q) for y, q in zip(ys, layers)) + tuple(ys[len(layers) :])


def mlx_dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)


def dense_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    dequantize: Callable[..., mx.array] = mlx_dequantize,
) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)` as the weights dequantized to their
    scales' dtype (`dequantize`: MLX's, or `engine.kernels.dequantize`'s, the same values), then one matrix
    multiply (cuBLAS on CUDA): for a prompt chunk the GEMM runs near the tensor cores' rate, and the
    dequantized copy (one matrix at a time, freed after) costs a pass over memory. Measured equal to MLX's
    quantized matmul on qwen27b's shapes on an H200, not promised: the fast tier."""
    return x @ dequantize(w, scales, biases, group_size, bits).T


def batch_rows(x: mx.array) -> int:
    """The rows of x's batch: a decode step's or a verify window's rows ([B, T, K]: B), whatever their tokens; of
    a flat [M, K], M."""
    return x.shape[0] if x.ndim > 2 else x.size // x.shape[-1]


def norm_eps(norm: tuple[mx.array, float] | None, prenormed: tuple[mx.array, float] | None) -> float:
    """The eps of the norm a launch takes (`norm` or `prenormed`; 0.0 for none)."""
    return (norm or prenormed or (None, 0.0))[1]


def stage_arrays(
    norm: tuple[mx.array, float] | None,
    residual: mx.array | None,
    norm_out: mx.array | None,
    prenormed: tuple[mx.array, float] | None,
) -> list[mx.array]:
    """The fused stages' input arrays that are asked for (None: not asked), in `Fusion.inputs`' order: what
    the kernel call and `_compiled`'s `run` take after the matrices."""
    arrays = (norm and norm[0], residual, norm_out, prenormed and prenormed[0])
    return [a for a in arrays if a is not None]


def stage_inputs(
    arrays: Sequence[mx.array], fusion: Fusion, eps: float
) -> tuple[tuple[mx.array, float] | None, mx.array | None, mx.array | None, tuple[mx.array, float] | None]:
    """`stage_arrays`' arrays back as (norm, residual, norm_out, prenormed), as a traced launch takes them."""
    extra = list(arrays)
    norm = (extra.pop(0), eps) if fusion.norm_scale else None
    residual = extra.pop(0) if fusion.residual else None
    norm_out = extra.pop(0) if fusion.norm_out else None
    prenormed = (extra.pop(0), eps) if fusion.prenormed else None
    return norm, residual, norm_out, prenormed


def with_bias(y: mx.array, q: nn.QuantizedLinear) -> mx.array:
    return y + q["bias"] if "bias" in q else y
