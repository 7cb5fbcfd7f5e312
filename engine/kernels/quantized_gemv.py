"""Affine-quantized matrix times a few activation rows, as one CUDA kernel.

`y = x @ dequantize(w).T` for M = 1..16 rows of bf16 activations against
4-bit or 8-bit affine weights (group 32 or 64): what decoding (M = 1) and a
speculative verify window (M = 2..16) spend most of a step on. MLX's built-in
kernel reaches a tenth of the H200's bandwidth at M = 1 and gets slower with
M; here one warp streams R weight rows once, dequantizes each 128-bit load in
registers and multiplies it with all M rows, so small M costs about what
M = 1 does.

Layout per warp: lane l takes 32 (4-bit) or 16 (8-bit) consecutive values of
each row per step, one 16-byte load, so a group's scale and bias are one
load per lane and step. All steps are unrolled so every load is issued
before the first multiply (the kernel is bound by bytes in flight). A nibble
becomes a float by OR-ing it into the mantissa of 2^23 and subtracting 2^23
(exact, and cheaper than an integer conversion). Sums are float32:
sum_g(scale * sum(q * x) + bias * sum(x)); the order differs from MLX's
kernel, so results agree to rounding, not bit for bit (the fast tier).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 16  # the kernel's limit
# Where the layer uses it: measured on the H200 (harness kernels), MLX's own
# kernels win from M = 8 on (they switch to a tiled GEMM there).
LAYER_MAX_ROWS = 4
# Small matrices (qwen27b's 48- and 1024-row projections) run faster in MLX's
# kernel: too few warps to hide the latency of ours (measured 0.5-0.7x there).
LAYER_MIN_OUTPUTS = 2048
BITS = (4, 8)
GROUP_SIZES = (32, 64)
THREADS_PER_BLOCK = 128
PREFETCH_STEPS = 8  # 16-byte loads in flight per lane (divided among a warp's rows)

HEADER = """
#include <cuda_bf16.h>
__device__ __forceinline__ float engine_q2f(uint32_t word, int shift, uint32_t mask) {
  // the integer value of (word >> shift) & mask, exactly, via the float 2^23 + q
  return __uint_as_float(((word >> shift) & mask) | 0x4B000000u) - 8388608.0f;
}
"""

SOURCE = """
  constexpr int VPL = 128 / BITS;            // values per lane per step: one 16-byte load
  constexpr int PER_WORD = 32 / BITS;
  constexpr int SPAN = 32 * VPL;             // values per warp per step
  constexpr int STEPS = (K + SPAN - 1) / SPAN;
  constexpr int WORDS_PER_ROW = K / PER_WORD;
  constexpr int GROUPS_PER_ROW = K / GS;
  constexpr uint32_t QMASK = (1u << BITS) - 1u;

  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (row0 >= N) return;

  float acc[R][M];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
  }

  // Issue BATCH steps of loads before the first multiply; bounded so the
  // registers holding them do not spill at K = 17408.
  constexpr int BATCH = STEPS < PREFETCH / R ? STEPS : PREFETCH / R;
  #pragma unroll 1
  for (int s0 = 0; s0 < STEPS; s0 += BATCH) {
    uint4 wq[BATCH][R];
    float sc[BATCH][R];
    float bi[BATCH][R];
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int k0 = (s0 + b) * SPAN + lane * VPL;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = min(row0 + r, N - 1);
        if (s0 + b < STEPS && k0 < K) {
          wq[b][r] = __ldcs(reinterpret_cast<const uint4*>(w + (size_t)row * WORDS_PER_ROW + k0 / PER_WORD));
          sc[b][r] = __bfloat162float(scales[(size_t)row * GROUPS_PER_ROW + k0 / GS]);
          bi[b][r] = __bfloat162float(biases[(size_t)row * GROUPS_PER_ROW + k0 / GS]);
        }
      }
    }
    #pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int k0 = (s0 + b) * SPAN + lane * VPL;
      if (s0 + b < STEPS && k0 < K) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[VPL];
          float xsum = 0.0f;
          const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
          #pragma unroll
          for (int j = 0; j < VPL / 8; ++j) {
            uint4 xv = __ldg(xp + j);
            const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&xv);
            #pragma unroll
            for (int h = 0; h < 4; ++h) {
              float2 f = __bfloat1622float2(pairs[h]);
              xf[j * 8 + 2 * h] = f.x;
              xf[j * 8 + 2 * h + 1] = f.y;
              xsum += f.x + f.y;
            }
          }
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint32_t* words = reinterpret_cast<const uint32_t*>(&wq[b][r]);
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < VPL; ++i) {
              dot = fmaf(engine_q2f(words[i / PER_WORD], (i % PER_WORD) * BITS, QMASK), xf[i], dot);
            }
            acc[r][m] = fmaf(sc[b][r], dot, fmaf(bi[b][r], xsum, acc[r][m]));
          }
        }
      }
    }
  }

  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
      #pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (lane == 0 && row0 + r < N) out[(size_t)m * N + row0 + r] = __float2bfloat16(v);
    }
  }
"""


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(
        name="engine_affine_qgemv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
    )


def rows_per_warp(m: int, n: int) -> int:
    """Weight rows one warp streams: more rows reuse each activation load and
    keep more bytes in flight, but leave fewer warps. Measured on the H200
    (harness/gpu/diag_gemv_rows.py, qwen27b shapes): 8 rows win from N = 16K
    on, 4 below; at M = 4 more rows win too."""
    if m > 4:
        return 1
    if n >= 16384:
        return 8
    return 4 if n >= 2048 else 1


def weight_refusal(w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str = "affine") -> Optional[str]:
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


def refusal(x: mx.array, w: mx.array, scales: mx.array, group_size: int, bits: int, mode: str = "affine") -> Optional[str]:
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


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    rows: Optional[int] = None,
    prefetch: int = PREFETCH_STEPS,
) -> mx.array:
    """x [..., K] bf16 times the quantized [N, K] matrix, transposed: [..., N] bf16 (CUDA only).
    `rows` (rows per warp) and `prefetch` (loads in flight per lane) override the tuned values."""
    k = x.shape[-1]
    n = w.shape[0]
    m = x.size // k
    r = rows or rows_per_warp(m, n)
    warps = (n + r - 1) // r
    (out,) = _kernel()(
        inputs=[x.reshape(m, k), w, scales, biases],
        template=[("K", k), ("N", n), ("M", m), ("R", r), ("BITS", bits), ("GS", group_size), ("PREFETCH", prefetch)],
        grid=(warps * 32, 1, 1),
        threadgroup=(THREADS_PER_BLOCK, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[mx.bfloat16],
    )
    return out.reshape(*x.shape[:-1], n)


@lru_cache(maxsize=None)
def _compiled(group_size: int, bits: int):
    # Traced once per input shape: later calls skip building the kernel call (template list, source
    # text) on the host, which at ~450 calls per decode step of a 27B model is what bounds the step.
    return mx.compile(lambda x, w, scales, biases: quantized_matmul(x, w, scales, biases, group_size, bits))


def retyped(q: nn.QuantizedLinear, cls: type) -> nn.QuantizedLinear:
    """The same layer (same arrays, no copies) as an instance of `cls`, a QuantizedLinear class."""
    new = cls.__new__(cls)
    new.__dict__.update(q.__dict__)
    dict.update(new, q)
    return new


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear that runs the kernel above where it applies and MLX's op elsewhere.

    The weights are checked once (`kernel_refusal`); per call only the
    activations' dtype and row count decide.
    """

    @classmethod
    def from_module(cls, q: nn.QuantizedLinear, use_kernel: bool) -> "KernelQuantizedLinear":
        new = retyped(q, cls)
        new.kernel_refusal = weight_refusal(q["weight"], q["scales"], q.group_size, q.bits, q.mode)
        if new.kernel_refusal is None and q["weight"].shape[0] < LAYER_MIN_OUTPUTS:
            new.kernel_refusal = f"{q['weight'].shape[0]} outputs (MLX's kernel is faster below {LAYER_MIN_OUTPUTS})"
        new.use_kernel = use_kernel and new.kernel_refusal is None
        return new

    def __call__(self, x: mx.array) -> mx.array:
        if not self.use_kernel or x.dtype != mx.bfloat16 or x.size > LAYER_MAX_ROWS * x.shape[-1]:
            return super().__call__(x)
        y = _compiled(self.group_size, self.bits)(x, self["weight"], self["scales"], self["biases"])
        return y + self["bias"] if "bias" in self else y
