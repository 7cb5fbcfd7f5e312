"""Affine-quantized matrix times a few activation rows, on the tensor cores.

`y = x @ dequantize(w).T` for M = 1..16 rows of bf16 activations against
4-bit or 8-bit affine weights (group 32 or 64): what decoding (M = 1) and a
speculative verify window spend most of a step on. The weights are read
once for all M rows, so M = 8 costs about what M = 1 does. Matrices that
share the input run in one launch, and a launch can take the work around
its products (the residual add, the SwiGLU, the next RMS norm).

- `source`: the kernel's CUDA text;
- `fusion`: the stages a launch adds around its products;
- `launch`: launch shapes (warps, row tiles, load batches);
- `calls`: the kernel calls (`quantized_matmuls`, compiled `run_kernel`);
- `layer`: `KernelQuantizedLinear`, which chooses the path per call.
"""

from engine.kernels.quantized_gemv.calls import (
    BITS,
    GROUP_SIZES,
    MAX_ROWS,
    dense_matmul,
    float_bits,
    launch_arguments,
    quantized_matmul,
    quantized_matmuls,
    refusal,
    run_kernel,
    weight_refusal,
)
from engine.kernels.quantized_gemv.fusion import DEFAULT_FUSION, Fusion
from engine.kernels.quantized_gemv.launch import (
    LaunchConfig,
    Launches,
    launch_config,
    launches_setting,
    parse_launches,
    tile_k,
)
from engine.kernels.quantized_gemv.layer import (
    DENSE_DTYPES,
    DENSE_MIN_ROWS,
    LAYER_MAX_ROWS,
    LAYER_MIN_OUTPUTS,
    KernelQuantizedLinear,
    no_bias,
    one_launch,
    retyped,
)
from engine.kernels.quantized_gemv.layouts import StagedLayouts
from engine.kernels.quantized_gemv.source import input_names, kernel_source, launch_bounds, output_names

__all__ = [
    "BITS",
    "DEFAULT_FUSION",
    "DENSE_DTYPES",
    "DENSE_MIN_ROWS",
    "GROUP_SIZES",
    "LAYER_MAX_ROWS",
    "LAYER_MIN_OUTPUTS",
    "MAX_ROWS",
    "Fusion",
    "KernelQuantizedLinear",
    "LaunchConfig",
    "Launches",
    "StagedLayouts",
    "dense_matmul",
    "float_bits",
    "input_names",
    "kernel_source",
    "launch_arguments",
    "launch_bounds",
    "launch_config",
    "launches_setting",
    "no_bias",
    "one_launch",
    "output_names",
    "parse_launches",
    "quantized_matmul",
    "quantized_matmuls",
    "refusal",
    "retyped",
    "run_kernel",
    "tile_k",
    "weight_refusal",
]
