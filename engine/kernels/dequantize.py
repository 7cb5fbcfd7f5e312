"""Affine dequantization as one CUDA kernel: MLX's values, read and written 16 bytes at a time.

The fast tier's dense path (prompt chunks of `dense_min_rows` rows and more) dequantizes every matrix it
multiplies, in every forward: on qwen27b 15 GB of packed weights read and 54 GB of bf16 written, ~16% of a
2048-token forward's device time on an H200 (docs/kernels.md, "Prefill"). MLX's kernel has each thread read
one byte and write its values one at a time (4 bytes for two 4-bit values), about 1.5 TB/s counted read +
write. Here a thread reads UNITS 16-byte runs of packed words (32 values each at 4 bits, 16 at 8) and
writes each run's values as 16-byte vectors; a block's runs are consecutive, so every load and store is
coalesced.

The values are MLX's bit for bit: each is `scale * q + bias` in the scales' dtype, written as MLX's kernel writes
it (`__hmul2` then `__hadd2`, the operations of its `scale * T(q) + bias`), so ptxas compiles both alike: one
fused multiply-add a value on sm_90 (HFMA2.BF16_V2 in both), the product and the sum rounded apart on sm_80.
The kernel takes 4- and 8-bit weights whose rows are whole runs and whose groups hold whole runs, with
bfloat16 or float16 scales; anything else, or a process off CUDA, gets `mx.dequantize`.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.kernels.cuda_source import cuda_kernel

THREADS = 256  # a block's threads
UNITS = 2  # 16-byte runs of packed weights a thread takes (a block: THREADS * UNITS consecutive runs)
KERNEL_BITS = (4, 8)
KERNEL_DTYPES = (mx.bfloat16, mx.float16)

_HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ __nv_bfloat162 engine_dq_ints(const __nv_bfloat16*, uint32_t a, uint32_t b) {
  return __floats2bfloat162_rn((float)a, (float)b);
}
__device__ __forceinline__ __half2 engine_dq_ints(const __half*, uint32_t a, uint32_t b) {
  return __floats2half2_rn((float)a, (float)b);
}
__device__ __forceinline__ __nv_bfloat162 engine_dq_splat(__nv_bfloat16 v) { return __bfloat162bfloat162(v); }
__device__ __forceinline__ __half2 engine_dq_splat(__half v) { return __half2half2(v); }
"""

_SOURCE = r"""
  constexpr int PW = 32 / BITS;                // values a 32-bit word
  constexpr int RUN = 4 * PW;                  // values a 16-byte run (inside one group: GS % RUN == 0)
  const size_t runs = (size_t)size[0];         // 16-byte runs in all
  const size_t first = ((size_t)blockIdx.x * UNITS) * blockDim.x + threadIdx.x;
  uint4 words[UNITS];
  #pragma unroll
  for (int u = 0; u < UNITS; ++u) {
    const size_t run = first + (size_t)u * blockDim.x;
    if (run < runs) words[u] = __ldcs(reinterpret_cast<const uint4*>(w) + run);
  }
  #pragma unroll
  for (int u = 0; u < UNITS; ++u) {
    const size_t run = first + (size_t)u * blockDim.x;
    if (run >= runs) break;
    const size_t group = run * RUN / GS;         // rows are whole groups: the flat value index over GS
    const auto scale = engine_dq_splat(scales[group]);
    const auto bias = engine_dq_splat(biases[group]);
    const uint32_t* word = reinterpret_cast<const uint32_t*>(&words[u]);
    uint4 vec[RUN / 8];                          // 8 values a 16-byte vector
    uint32_t* pairs = reinterpret_cast<uint32_t*>(vec);
    #pragma unroll
    for (int i = 0; i < 4; ++i)
      #pragma unroll
      for (int j = 0; j < PW / 2; ++j) {
        // values 2j and 2j + 1 of word i (value v: bits [v * BITS, (v + 1) * BITS), MLX's packing)
        constexpr uint32_t MASK = (1u << BITS) - 1;
        const uint32_t lo = (word[i] >> (2 * j * BITS)) & MASK, hi = (word[i] >> ((2 * j + 1) * BITS)) & MASK;
        const auto q = engine_dq_ints(scales, lo, hi);
        const auto v = __hadd2(__hmul2(scale, q), bias);
        pairs[i * PW / 2 + j] = *reinterpret_cast<const uint32_t*>(&v);
      }
    uint4* dst = reinterpret_cast<uint4*>(out) + run * (RUN / 8);
    #pragma unroll
    for (int i = 0; i < RUN / 8; ++i) dst[i] = vec[i];
  }
"""


@cache
def _kernel():
    return cuda_kernel(
        name="engine_affine_dequantize",
        input_names=["w", "scales", "biases", "size"],
        output_names=["out"],
        source=_SOURCE,
        header=_HEADER,
    )


def kernel_refusal(w: mx.array, scales: mx.array, group_size: int, bits: int) -> str | None:
    """Why the kernel does not take these weights (None where it does; the process's device aside)."""
    if bits not in KERNEL_BITS:
        return f"{bits}-bit weights (the kernel takes {' and '.join(map(str, KERNEL_BITS))})"
    if scales.dtype not in KERNEL_DTYPES:
        return f"{scales.dtype} scales (the kernel takes bfloat16 and float16)"
    if w.ndim != 2 or w.dtype != mx.uint32:
        return "weights not a 2-D uint32 matrix"
    run = 128 // bits
    k = w.shape[1] * 32 // bits
    if k % run or group_size % run:
        return f"{k} inputs a row in groups of {group_size}: not whole {run}-value runs"
    return None


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """`mx.dequantize(w, scales, biases, group_size, bits)`: through the kernel on CUDA where it takes the
    weights (the same values bit for bit), else MLX's operation."""
    from engine.kernels import on_cuda  # the package imports this module before it defines on_cuda

    if not on_cuda() or kernel_refusal(w, scales, group_size, bits):
        return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    return dequantize_kernel(w, scales, biases, group_size, bits)


def dequantize_kernel(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """The kernel's launch for weights it takes (`kernel_refusal` None), on any backend that runs it."""
    n, k = w.shape[0], w.shape[1] * 32 // bits
    runs = n * k * bits // 128
    blocks = -(-runs // (THREADS * UNITS))
    return _kernel()(
        inputs=[w, scales, biases, mx.array([runs], dtype=mx.int64)],
        template=[("BITS", bits), ("GS", group_size), ("UNITS", UNITS)],
        output_shapes=[(n, k)],
        output_dtypes=[scales.dtype],
        grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
    )[0]
