"""The fast tier's quantized linear layer: the GEMV kernel where it pays, MLX's operation elsewhere.

Where the layer uses which path was measured on an H200 with qwen27b's shapes
(docs/kernels.md): the kernel for up to `LAYER_MAX_ROWS` rows through
matrices of at least 2048 outputs (MLX's kernel wins below); prompt chunks of
more rows than the kernel takes (`DENSE_MIN_ROWS`) as a dequantize and one GEMM, so
that MLX's quantized matmul, whose JIT compilation is the longest of a start, never
runs in a forward of the model (with `dense_min_rows` set higher, the chunks in between run the
kernel in launches of its most rows: `in_pieces`). MLX's operation takes the rows as one matrix:
given a batch [B, 1, K], it runs B one-row products, each reading all the
weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.dequantize import dequantize as kernel_dequantize
from engine.kernels.quantized_gemv.calls import dense_matmul, mlx_dequantize, run_kernel, weight_refusal, with_bias
from engine.kernels.quantized_gemv.launch import Launches
from engine.kernels.quantized_gemv.layouts import NO_LAYOUTS, StagedLayouts

LAYER_MAX_ROWS = 64
LAYER_MIN_OUTPUTS = 2048  # the default of KernelConfig.gemv_min_outputs
DENSE_MIN_ROWS = LAYER_MAX_ROWS + 1  # the default of KernelConfig.dense_min_rows (docs/kernels.md, "Prefill")
# Half-precision layers only: CUDA runs a float32 GEMM as TF32, less exact than MLX's quantized matmul.
DENSE_DTYPES = (mx.bfloat16, mx.float16)

# `launch(x, layers, **stages)`: one launch for the layers that share x, as `calls.run_kernel` takes it
Launch = Callable[..., tuple]


class KeptWeight:
    """A layer's weights dequantized once and kept for its dense prompt chunks (`KernelConfig.keep_dense`): held
    outside the module's parameters, so saving, counting and re-installing the weights never see the copy."""

    def __init__(self, weight: mx.array):
        self.weight = weight


def retyped(q: nn.QuantizedLinear, cls: type) -> nn.QuantizedLinear:
    """The same layer (same arrays, no copies) as an instance of `cls`, a QuantizedLinear class."""
    new = cls.__new__(cls)
    new.__dict__.update(q.__dict__)
    dict.update(new, q)
    return new


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear that runs the kernel where it applies and MLX's op elsewhere.

    The weights are checked once (`kernel_refusal`); per call only the activations' dtype and row count
    decide. `launch` is how a launch is computed (`calls.run_kernel`; a test may stand another in),
    `launches` the one-row launch shapes it takes, `layouts` the staged launches' changes by row count,
    `dequantize` how the dense path dequantizes the weights
    (MLX's operation, or the engine's kernel with `dequant_kernel`: the same values).
    """

    @classmethod
    def from_module(
        cls,
        q: nn.QuantizedLinear,
        use_kernel: bool,
        *,
        min_outputs: int = LAYER_MIN_OUTPUTS,
        dense_min_rows: int | None = DENSE_MIN_ROWS,
        launches: Launches = {},
        layouts: StagedLayouts = NO_LAYOUTS,
        launch: Launch = run_kernel,
        keep_dense: bool = False,
        dequant_kernel: bool = False,
    ) -> KernelQuantizedLinear:
        new = retyped(q, cls)
        new.kernel_refusal = weight_refusal(q["weight"], q["scales"], q.group_size, q.bits, q.mode)
        new.groupable = use_kernel and new.kernel_refusal is None  # may share one launch with other layers
        if new.kernel_refusal is None and q["weight"].shape[0] < min_outputs:
            new.kernel_refusal = f"{q['weight'].shape[0]} outputs (MLX's kernel is faster below {min_outputs})"
        new.use_kernel = use_kernel and new.kernel_refusal is None
        new.min_outputs = min_outputs
        new.dense_prefill = (
            use_kernel and dense_min_rows is not None and q.mode == "affine" and q["scales"].dtype in DENSE_DTYPES
        )
        new.dense_min_rows = dense_min_rows
        new.dequantize = kernel_dequantize if dequant_kernel else mlx_dequantize
        new.kept = None
        if keep_dense and new.dense_prefill:
            new.keep_dense()
        new.launches = frozenset(launches.items())  # not a tuple: nn.Module would keep that as a child
        new.layouts = layouts
        new.launch = launch
        return new

    def __call__(self, x: mx.array) -> mx.array:
        if self.dense_prefill and x.size >= self.dense_min_rows * x.shape[-1]:
            if self.kept is not None:  # the same product as dense_matmul's, on the copy made once
                return with_bias(x @ self.kept.weight.T, self)
            y = dense_matmul(
                x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self.dequantize
            )
            return with_bias(y, self)
        if self.use_kernel and _takes(x, self):
            return self.launch(x, [self])[0]
        if self.use_kernel and self.dense_prefill and _fits(x, self):  # below dense_min_rows, past a launch's rows
            return self.in_pieces(x)
        return self.mlx_matmul(x)

    def keep_dense(self) -> KeptWeight:
        """Its dense prompt chunks' weights dequantized once and kept (`KernelConfig.keep_dense`): the copy, lazy."""
        self.kept = KeptWeight(
            self.dequantize(self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        )
        return self.kept

    def in_pieces(self, x: mx.array) -> mx.array:
        """A chunk of more rows than a launch takes but fewer than `dense_min_rows` (set above the kernel's rows):
        its rows in launches of LAYER_MAX_ROWS, each row's products as any launch computes them."""
        flat = x.reshape(1, -1, x.shape[-1])
        pieces = range(0, flat.shape[1], LAYER_MAX_ROWS)
        ys = [self.launch(flat[:, i : i + LAYER_MAX_ROWS], [self])[0] for i in pieces]
        return mx.concatenate(ys, axis=1).reshape(*x.shape[:-1], -1)

    def mlx_matmul(self, x: mx.array) -> mx.array:
        """MLX's operation on x's rows as one [rows, K] matrix."""
        if x.ndim <= 2:
            return super().__call__(x)
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    @staticmethod
    def project_together(x: mx.array, layers: Sequence[nn.Module]) -> tuple[mx.array, ...]:
        """Each layer applied to x, in one launch where the kernel takes them all (the projections that
        share an input: gate and up, q/k/v, a DeltaNet's inputs); small ones then ride along with the rest."""
        together = len(layers) > 1 and one_launch(x, layers)
        return layers[0].launch(x, layers) if together else tuple(q(x) for q in layers)


def one_launch(x: mx.array, layers: Sequence[nn.Module]) -> bool:
    """Whether the kernel takes all the layers with x in one launch (same bits and group size, enough rows)."""
    first = layers[0]
    return (
        all(
            getattr(q, "groupable", False) and (q.group_size, q.bits) == (first.group_size, first.bits) and _takes(x, q)
            for q in layers
        )
        and sum(q["weight"].shape[0] for q in layers) >= first.min_outputs
    )


def no_bias(layers: Sequence[nn.Module]) -> bool:
    """Whether none of the layers adds a bias: a launch's fused stages work on its bare products (`run_kernel`
    adds a bias only to a result the launch returns)."""
    return not any("bias" in q for q in layers)


def _takes(x: mx.array, q: nn.QuantizedLinear) -> bool:
    """Whether the kernel computes q(x): bf16 activations, at most LAYER_MAX_ROWS rows, q's input size."""
    return _fits(x, q) and x.size <= LAYER_MAX_ROWS * x.shape[-1]


def _fits(x: mx.array, q: nn.QuantizedLinear) -> bool:
    """bf16 activations of q's input size (in launches of at most LAYER_MAX_ROWS rows)."""
    return x.dtype == mx.bfloat16 and q["weight"].shape[1] * 32 // q.bits == x.shape[-1]
