"""MLX's indexing kernels compiled while the engine's own kernels build, off the warm-up's critical path.

MLX's CUDA backend compiles each of its gather kernels with NVRTC on first use, one module at a time and a
few seconds each, named by the array's and the indices' dtypes (`gather_<dtype>_<index dtype>_<n>`,
`gather_axis_<dtype>_<index dtype>`), whatever the shapes. A full warm-up first meets them in its decode
rows stage: the embedding (quantized words and their bf16 scales, by int32 prompt and uint32 sampled
tokens) and the batch caches (rows kept by int32 index, padding rolled along an axis). Evaluating one tiny
gather of each kind for the dtypes the model holds, on the main thread while the engine's kernels compile
in other processes (`kernel_cache`), moves those compilations into that wait. MLX keeps them in its module
cache directory, so a restart compiles none; off CUDA nothing compiles.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

INDEX_DTYPES = (mx.int32, mx.uint32)  # prompt tokens and cache rows; sampled tokens


def model_dtypes(model: nn.Module) -> set:
    """The dtypes of the model's arrays, and float32 (recurrent state, sampling)."""
    return {a.dtype for _, a in tree_flatten(model.parameters())} | {mx.float32}


def compile_indexing(model: nn.Module, activations=mx.bfloat16) -> int:
    """Evaluate a one-row gather of every model dtype by each index dtype, and a gather along an axis of the
    activations' dtype (the KV caches' padding roll); returns how many ops ran."""
    ops = []
    for dtype in sorted(model_dtypes(model), key=str):
        for index in INDEX_DTYPES:
            ops.append(mx.take(mx.zeros((2, 4), dtype=dtype), mx.array([1], dtype=index), axis=0))
    ops.append(mx.take_along_axis(mx.zeros((2, 4), dtype=activations), mx.zeros((2, 1), dtype=mx.int32), axis=1))
    mx.eval(ops)
    return len(ops)
