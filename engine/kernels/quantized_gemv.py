"""Affine-quantized matrix times a few activation rows, on the tensor cores.

`y = x @ dequantize(w).T` for M = 1..16 rows of bf16 activations against
4-bit or 8-bit affine weights (group 32 or 64): what decoding (M = 1) and a
speculative verify window (M = 2..16) spend most of a step on. MLX's
built-in kernel reads a 4-bit matrix at ~0.85 TB/s at M = 1 on the H200 and
at a quarter of that at M = 4; this one reads the weights once for all M
rows, so M = 8 costs about what M = 1 does.

The weights go through `mma.sync` (m16n8k16, bf16 in, float32 out) as
exact small integers: a nibble becomes bf16 128 + q by OR-ing it into the
mantissa (one LOP3 a pair of values). The activations are the 16x8 B operand
(M <= 8 in one column block, two from M = 9). Lane (g, t) of a warp feeds
rows g and g + 8 of a 16-row tile with its own 1-2 words of each row; the
dot product's order over k is free, so its B slots take the activations in
the order its weight pairs come, and no data moves between lanes. Each
k-tile lies in one quantization group: the tile's products are summed on
the tensor core, then `acc += scale * sum((128 + q) * x) + (bias - 128 *
scale) * sum(x)` in float32, where sum(x) comes from a second mma against
ones: the 128 leaves once a k-tile instead of by a subtraction from every
pair of values (H200, qwen27b, under Nsight Compute: a decode step's device
time 8.81 -> 8.28 ms; reports/gpu/step-kernels-session13.txt). Nothing is
rounded before the bf16 output (MLX's CUDA kernel rounds the dequantized
weights to bf16), so results agree with MLX's to rounding, not bit for bit
(the fast tier).

For prompt chunks (`DENSE_MIN_ROWS` rows and more) the layer dequantizes the
matrix and runs one bf16 GEMM instead (`dense_matmul`), which on the H200
runs the linear layers of a 1K-token prefill 2.5x faster than MLX's
quantized matmul.

A launch may also do the work around its products that would otherwise be
launches of their own (`Fusion`): on its input, the RMS norm or the SwiGLU of
an MLP's gate and up outputs; on its output rows, a residual add, or (gate
and up in one launch) the SwiGLU itself. Each launch the host submits and
the device runs in a decode step costs time on both, so fewer launches is
one lever; but the stages on the input measured slower in the model (H200,
qwen27b, fast tier, alternating: 61.5 / 57.1 tok/s fused against 83.6 / 92.0
unfused; every block then computes the norm over the whole input before its
first weight load, and the SwiGLU of every input value it reads), so only
the stages on the output rows are on (`FUSE`). The RMS norm can also be
taken after the products (`Fusion.norm_scale`: the activations times the
norm's weight, each row's sums scaled by the norm's rsqrt, whose sum of
squares the block gathers from the loads it makes anyway); its CUDA test
passes, but it makes the launches it joins slower than what it saves, so it
is off (`FUSE`). Or the launch before takes it (`Fusion.norm_out`: its output
rows times the norm's weight, and their sums of squares; `Fusion.prenormed`:
the next launch scales its rows' sums at the end), which is on.
`layer_launches` says which launch of a decoder layer takes what.

Matrices that share the input run in one launch (`quantized_matmuls`): the
blocks take them one after another, each block computing exactly what it
would in that matrix's own launch, so small matrices (a DeltaNet layer's
48-row gate projections) ride along with large ones instead of paying a
launch each.

A block's W warps split K; `U` k-tiles of loads are issued before the first
multiply; the partial products meet in shared memory. Configurations were
chosen by timing on the H200 with weights rotated past the L2
(harness/gpu/diag_gemv_configs.py). Ways of keeping more bytes in flight
measured no faster there and were removed: a pipelined form (the next
batch's loads before this batch's multiplies, in a second register set); a
bulk L2 prefetch of the block's rows at its start
(reports/gpu/gemv-configs-pipelined-prefetch-qwen27b.txt); loads staged
through shared memory by cp.async, twice (a block's chunks of 16 k-tiles in
the ninth session; a ring of 2-4 batches a warp, slower on every shape, e.g.
5120x17408 29.3 us against 25.3: reports/gpu/gemv-configs-ring-session15.txt);
and the activations copied into shared memory once a block after its first
weight loads are issued (so a k-tile's activations are not an L2 round trip
after its weights), which gave the same bits and was slower in every grouped
launch and in the model (a decode step's device time 9.37 against 8.81 ms;
reports/gpu/step-kernels-xs-session13.txt); and each launch asking the L2 (`prefetch.global.L2::evict_last`)
for the first 512-2048 bytes of every row of the next launch's matrices, after its stores or before its
loads, so the next launch's first loads would not wait on HBM: a chain of qwen27b gate+up and down launches
took 66.0 us a layer without, 67.8-78.3 with, slower the more it fetched
(reports/gpu/gemv-prefetch-session16.txt). Nor did taking a batch's activation loads off their chain (each
k-tile's loads wait behind the branch of its bounds check, so after the tile before's products: one L2 round
trip a tile): asked of the L1 beside the batch's weight loads, a decode step's device time 8.17 ms against
7.30 under Nsight Compute, every GEMV launch slower (gate+up 44.8 us against 39.1); all loaded before the
first tile's products, 8.89 ms (more registers: down 98 against 74, gate+up spills at five blocks an SM);
the same bits either way (reports/gpu/step-kernels-activations-session16.txt).
Nor did more warps an SM for the launches of only 320 row tiles (down, o_proj / out) by splitting each row
tile's K over S blocks whose parts the tile's last block added in split order (commit 30ff426, removed):
with (4, 1, 4) at 8 blocks an SM and S = 3 (960 blocks, one wave), down 29.7 us against 25.0 and o_proj 14.2
against 12.1, a step's device time 7.67 ms against 7.19; (2, 1, 4) at 16 blocks and S = 6, 7.73
(reports/gpu/step-kernels-splits-session17.txt). Its CUDA test passed: it was correct, just slower.
What did pay is fewer waves: a launch whose blocks overflow what the SMs
hold at once by a few runs a nearly empty last wave (`LaunchConfig.min_blocks`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine import env
from engine.kernels.cuda_source import cuda_kernel

MAX_ROWS = 16  # the kernel's limit
# Where the layer uses it (H200, qwen27b shapes, cold weights): at M = 16 MLX's tiled GEMM is as fast.
LAYER_MAX_ROWS = 8
# Small matrices (qwen27b's 48- and 1024-row projections) run faster in MLX's
# kernel: too few blocks to keep the memory busy (measured 0.5x at 1024 rows).
LAYER_MIN_OUTPUTS = 2048
# Prompt chunks of at least this many rows, through matrices of at least DENSE_MIN_OUTPUTS rows, run as
# a dequantize to bf16 and one GEMM (`dense_matmul`); None: MLX's quantized matmul. H200, qwen27b's
# shapes (reports/gpu/prefill-qwen27b.json): 17408x5120 at M = 512 takes 368 us against MLX's 709, at
# M = 256 473 against 439; at M = 1023 the linear layers of a prefill take 159 ms against 394. The
# 48-row matrices are slower this way (55 us against 46).
DENSE_MIN_ROWS: Optional[int] = 512
DENSE_MIN_OUTPUTS = 1024
# Half-precision layers only: CUDA runs a float32 GEMM as TF32, less exact than MLX's quantized matmul.
DENSE_DTYPES = (mx.bfloat16, mx.float16)
BITS = (4, 8)
GROUP_SIZES = (32, 64)

HEADER = r"""
#include <cuda_bf16.h>
template <int WL> struct engine_words { using type = uint2; };
template <> struct engine_words<1> { using type = uint32_t; };
template <int U> struct engine_scale_vec { using type = uint2; };   // 4 bf16
template <> struct engine_scale_vec<8> { using type = uint4; };     // 8 bf16
__device__ __forceinline__ void engine_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
  // d (16x8 float32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major)
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float2 engine_bf16x2(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
__device__ __forceinline__ uint32_t engine_to_bf16x2(float a, float b) {
  __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t engine_norm2(uint32_t x, uint32_t w, float r) {
  // two values of MLX's rms_norm: w * bf16(x * r), rounded to bf16
  const float2 xf = engine_bf16x2(x), wf = engine_bf16x2(w);
  const float2 n = engine_bf16x2(engine_to_bf16x2(xf.x * r, xf.y * r));
  return engine_to_bf16x2(wf.x * n.x, wf.y * n.y);
}
__device__ __forceinline__ uint32_t engine_mul2(uint32_t x, uint32_t w) {
  // two products x * w of bf16 values, rounded to bf16
  const float2 xf = engine_bf16x2(x), wf = engine_bf16x2(w);
  return engine_to_bf16x2(xf.x * wf.x, xf.y * wf.y);
}
__device__ __forceinline__ float engine_sumsq8(const uint4 v, float s) {
  // s plus the squares of 8 bf16 values, in float32
  const uint32_t* p = reinterpret_cast<const uint32_t*>(&v);
  #pragma unroll
  for (int j = 0; j < 4; ++j) { const float2 f = engine_bf16x2(p[j]); s = fmaf(f.x, f.x, fmaf(f.y, f.y, s)); }
  return s;
}
__device__ __forceinline__ float engine_silu_bf16(float g) {
  // silu(g), rounded to bf16
  return __bfloat162float(__float2bfloat16(g / (1.0f + expf(-g))));
}
__device__ __forceinline__ uint32_t engine_swiglu2(uint32_t g, uint32_t u) {
  // two values of silu(gate) * up as bf16 operations: silu rounded to bf16, then the product
  const float2 gf = engine_bf16x2(g), uf = engine_bf16x2(u);
  return engine_to_bf16x2(engine_silu_bf16(gf.x) * uf.x, engine_silu_bf16(gf.y) * uf.y);
}
// What engine_pair adds to every weight value (BITS = 4: bf16 128 + q; BITS = 8: q). The offset is taken out
// once a k-tile through the bias term, as (bias - OFFSET * scale) * sum(x), not from every value.
template <int BITS> struct engine_offset { static constexpr float value = BITS == 4 ? 128.0f : 0.0f; };
template <int BITS>
__device__ __forceinline__ uint32_t engine_pair(uint32_t word, int j) {
  // values j and j + 16 / BITS of a 32-bit word as two exact bf16 integers plus engine_offset (low half: value j)
  if constexpr (BITS == 4) {
    // (word >> 4j) & 0x000F000F | 0x43004300 in one LOP3: the constants in registers, as one instruction has
    // room for one immediate (two LOP3s otherwise)
    uint32_t v;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(word >> (4 * j)), "r"(0x000F000Fu), "r"(0x43004300u));
    return v;
  } else {
    uint32_t v = word >> (8 * j);
    __nv_bfloat162 r = __floats2bfloat162_rn((float)(v & 0xFFu), (float)((v >> 16) & 0xFFu));
    return *reinterpret_cast<uint32_t*>(&r);
  }
}
"""

_BODY_START = r"""
  // Threads: W warps, all on the same 16 * RT weight rows, splitting K. Lane (g, t) = (lane / 4, lane % 4).
  constexpr int PW = 32 / BITS;                     // values per 32-bit word
  constexpr int HALF = PW / 2;
  constexpr int SPW = PW / 4;                       // mma steps (16 k values) per word
  constexpr int WL = GS * BITS / 128 < 2 ? GS * BITS / 128 : 2;  // words per lane per row in one k-tile
  constexpr int TILE_K = 4 * WL * PW;               // a k-tile: 4 lanes x WL words, inside one group
  constexpr int KT = K / TILE_K;
  constexpr int STEPS = WL * SPW;
  constexpr int XR = WL * PW / 2;                   // activation registers (bf16 pairs) per lane and tile
  constexpr int NB = M > 8 ? 2 : 1;                 // 8-column blocks of activation rows
  constexpr int WORDS_PER_ROW = K / PW;
  constexpr int GROUPS_PER_ROW = K / GS;
  using Words = typename engine_words<WL>::type;
  // Scales and biases of a batch in one load when each k-tile is one group and batches stay aligned.
  constexpr bool VEC_SCALES = TILE_K == GS && (U == 4 || U == 8) && GROUPS_PER_ROW % U == 0;
  using ScaleVec = typename engine_scale_vec<U>::type;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row_base = blk * 16 * RTO;
  auto tile_row = [&](const int r) { return row_base + (r % RTO) * 16; };  // row tile r's first row
  const uint32_t ones = 0x3F803F80u;                // bf16 (1, 1)
  // FUSED STAGES

  float acc[RT][NB][4];
  #pragma unroll
  for (int r = 0; r < RT; ++r)
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
      #pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][nb][i] = 0.0f;

  // A batch: U consecutive k-tiles of this warp's rows, all loads issued before the first multiply.
  struct Batch {
    Words wq[U][RT][2];
    __nv_bfloat16 sc[U][RT][2], bi[U][RT][2];
  };
"""

_LOAD_REGISTERS = r"""
  auto load = [&](Batch& bt, const int kt0) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kt = kt0 + u;
      if (kt < KT) {
        #pragma unroll
        for (int r = 0; r < RT; ++r) {
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const size_t row = min(tile_row(r) + g + 8 * h, N - 1);
            bt.wq[u][r][h] = __ldcs(reinterpret_cast<const Words*>(tile_w(r) + row * WORDS_PER_ROW + kt * 4 * WL + t * WL));
            if constexpr (!VEC_SCALES) {
              bt.sc[u][r][h] = tile_scales(r)[row * GROUPS_PER_ROW + kt * TILE_K / GS];
              bt.bi[u][r][h] = tile_biases(r)[row * GROUPS_PER_ROW + kt * TILE_K / GS];
            }
          }
        }
      }
    }
    if constexpr (VEC_SCALES) {  // one k-tile per group and U groups per batch: one vector load per row
      #pragma unroll
      for (int r = 0; r < RT; ++r) {
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const size_t row = min(tile_row(r) + g + 8 * h, N - 1);
          ScaleVec sv = *reinterpret_cast<const ScaleVec*>(tile_scales(r) + row * GROUPS_PER_ROW + kt0);
          ScaleVec bv = *reinterpret_cast<const ScaleVec*>(tile_biases(r) + row * GROUPS_PER_ROW + kt0);
          #pragma unroll
          for (int u = 0; u < U; ++u) {
            bt.sc[u][r][h] = reinterpret_cast<const __nv_bfloat16*>(&sv)[u];
            bt.bi[u][r][h] = reinterpret_cast<const __nv_bfloat16*>(&bv)[u];
          }
        }
      }
    }
  };
"""

_MULTIPLY = r"""
  auto multiply = [&](const Batch& bt, const int kt0) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kt = kt0 + u;
      if (kt < KT) {
        // The activations as mma B fragments. The dot product's k order is free: lane t's k-tile values
        // (its own WL words) feed its four B slots of each step in the order the weights' pairs come.
        uint32_t xb[NB][STEPS][2];
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          const int m = g + 8 * nb;
          uint32_t xr[XR];
          if (m < M) {
            const size_t k0 = (size_t)m * K + kt * TILE_K + t * WL * PW;
            #pragma unroll
            for (int j = 0; j < XR / 4; ++j) {
              const uint4 v = activations(k0 + 8 * j, m);
              xr[4 * j] = v.x; xr[4 * j + 1] = v.y; xr[4 * j + 2] = v.z; xr[4 * j + 3] = v.w;
            }
          } else {
            #pragma unroll
            for (int j = 0; j < XR; ++j) xr[j] = 0u;
          }
          #pragma unroll
          for (int wi = 0; wi < WL; ++wi)
            #pragma unroll
            for (int h = 0; h < SPW; ++h) {
              const int a = wi * PW / 2 + h;
              xb[nb][wi * SPW + h][0] = __byte_perm(xr[a], xr[a + HALF / 2], 0x5410);  // x[2h], x[2h + HALF]
              xb[nb][wi * SPW + h][1] = __byte_perm(xr[a], xr[a + HALF / 2], 0x7632);  // x[2h + 1], x[2h + 1 + HALF]
            }
        }
        // sum(x) over the tile per activation row, in the accumulator layout: the bias term
        float xs[NB][4];
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          #pragma unroll
          for (int i = 0; i < 4; ++i) xs[nb][i] = 0.0f;
          #pragma unroll
          for (int s = 0; s < STEPS; ++s) engine_mma(xs[nb], ones, ones, ones, ones, xb[nb][s][0], xb[nb][s][1]);
        }
        #pragma unroll
        for (int r = 0; r < RT; ++r) {
          float d[NB][4];
          #pragma unroll
          for (int nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int i = 0; i < 4; ++i) d[nb][i] = 0.0f;
          const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&bt.wq[u][r][0]);
          const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&bt.wq[u][r][1]);
          #pragma unroll
          for (int wi = 0; wi < WL; ++wi)
            #pragma unroll
            for (int h = 0; h < SPW; ++h) {
              const uint32_t a0 = engine_pair<BITS>(w0[wi], 2 * h), a2 = engine_pair<BITS>(w0[wi], 2 * h + 1);
              const uint32_t a1 = engine_pair<BITS>(w1[wi], 2 * h), a3 = engine_pair<BITS>(w1[wi], 2 * h + 1);
              #pragma unroll
              for (int nb = 0; nb < NB; ++nb) engine_mma(d[nb], a0, a1, a2, a3, xb[nb][wi * SPW + h][0], xb[nb][wi * SPW + h][1]);
            }
          const float s0 = __bfloat162float(bt.sc[u][r][0]), s1 = __bfloat162float(bt.sc[u][r][1]);
          // the bias term less the offset engine_pair put in every weight value: sum((q + o) x) = sum(q x) + o sum(x)
          constexpr float o = engine_offset<BITS>::value;
          const float b0 = fmaf(-o, s0, __bfloat162float(bt.bi[u][r][0])), b1 = fmaf(-o, s1, __bfloat162float(bt.bi[u][r][1]));
          #pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            acc[r][nb][0] = fmaf(s0, d[nb][0], fmaf(b0, xs[nb][0], acc[r][nb][0]));
            acc[r][nb][2] = fmaf(s1, d[nb][2], fmaf(b1, xs[nb][2], acc[r][nb][2]));
            if constexpr (M > 1) {  // odd accumulators hold columns 2t + 1: never an activation row at M = 1
              acc[r][nb][1] = fmaf(s0, d[nb][1], fmaf(b0, xs[nb][1], acc[r][nb][1]));
              acc[r][nb][3] = fmaf(s1, d[nb][3], fmaf(b1, xs[nb][3], acc[r][nb][3]));
            }
          }
        }
      }
    }
  };

"""

_LOOP_REGISTERS = r"""
  // Warp w takes U consecutive k-tiles at a time, every W * U tiles.
  #pragma unroll 1
  for (int kt0 = warp * U; kt0 < KT; kt0 += W * U) {
    Batch bt;
    load(bt, kt0);
    multiply(bt, kt0);
  }

"""

_REDUCE = r"""
  // ROW SCALE
  // Sum the W warps' partial products; accumulator i of lane (g, t): row g + 8 * (i / 2), column 2t + i % 2.
  __shared__ float red[W][16 * RT][8 * NB];
  #pragma unroll
  for (int r = 0; r < RT; ++r)
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
      #pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][r * 16 + g + 8 * (i / 2)][nb * 8 + 2 * t + i % 2] = acc[r][nb][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < 16 * RTO * M; idx += W * 32) {
    const int rl = idx / M, m = idx % M;
    const float rs = row_scale(m);
    float v = 0.0f, v_up = 0.0f;  // v_up: the up projection's sum beside the gate's (GATED)
    #pragma unroll
    for (int ww = 0; ww < W; ++ww) {
      v += red[ww][rl][m];
      if constexpr (GATED) v_up += red[ww][rl + 16 * RTO][m];
    }
    const int row = row_base + rl;
    if (row < N) store(rl, m, row, output(v * rs, v_up * rs, (size_t)m * N + row));
  }
  // AFTER STORES
"""


_NO_ROW_SCALE = "  auto row_scale = [&](const int) { return 1.0f; };\n"

# Fusion.prenormed: x is already the norm's activations (times its weight), and the producing launch left the
# sums of squares of the norm's input in P blocks' parts (`Fusion.norm_out`). The block copies the parts to
# shared memory with cp.async before its first weight load (`_PRENORMED_PREFETCH`: the copy holds no
# registers over the loop), so they are there by the end; warp 0 then adds each row's parts in a fixed order
# (lane-strided, then a butterfly), before _REDUCE's barrier. (The copy was written while the launch was
# slow for another reason, the eps array that `float_bits` explains; with that gone the gate+up launch
# takes 42.6 us against the plain one's 41.0, reports/gpu/step-kernels-norm-out-session14.txt. The parts
# read at the end instead were not timed since.)
_PRENORMED_PREFETCH = r"""
  __shared__ float ssq_parts[M * P];
  for (int i = threadIdx.x; i < M * P; i += W * 32) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(ssq_parts + i));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(ssq_in + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
"""
_PRENORMED_REDUCE = r"""
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  __shared__ float rscale[M];
  if (warp == 0) {
    for (int m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int p = lane; p < P; p += 32) s += ssq_parts[m * P + p];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) rscale[m] = rsqrtf(s / K + __int_as_float(EPS));
    }
  }
  auto row_scale = [&](const int m) { return rscale[m]; };
"""

# Fusion.norm_out: besides its rows of the residual stream, the launch writes them times the next norm's weight
# (hw, bf16) and its part of each row's sum of squares (ssq_out [M, blocks]: its rows' squares added in row
# order), so the next launch takes the norm without a launch of its own or any work a k-tile (`prenormed`).
_NORM_OUT_PROLOGUE = r"""
  for (int i = threadIdx.x; i < 16 * RTO * M; i += W * 32) sq[i / M][i % M] = 0.0f;
"""
_NORM_OUT_AFTER = r"""
  __syncthreads();
  for (int m = threadIdx.x; m < M; m += W * 32) {
    float s = 0.0f;
    for (int rl = 0; rl < 16 * RTO; ++rl) s += sq[rl][m];
    ssq_out[(size_t)m * gridDim.x + blockIdx.x] = s;
  }
"""

# Fusion.norm_scale: the four lanes of a row (t = 0..3) hold its sums of squares over their k values; the
# warps' totals go through shared memory (written before _REDUCE's barrier), so row m's scale is
# rsqrt(sum over warps / K + eps).
_NORM_SCALE_REDUCE = r"""
  __shared__ float ssr[W][8 * NB];
  #pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    float s = ssq[nb];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (t == 0) ssr[warp][g + 8 * nb] = s;
  }
  auto row_scale = [&](const int m) {
    float s = 0.0f;
    #pragma unroll
    for (int ww = 0; ww < W; ++ww) s += ssr[ww][m];
    return rsqrtf(s / K + __int_as_float(EPS));
  };
"""


def _prologue(count: int, gated: bool = False) -> str:
    """The block's matrix among `count` that share the input: blocks run matrix after matrix, matrix i from
    block BLK{i}; sets the pointers and the row count the body reads (w, scales, biases, out, N, blk), the
    output row tiles of a block (RTO) and which matrix row tile r reads (tile_w, tile_scales, tile_biases;
    the body's tile_row gives its rows). `gated` (two matrices, gate and up): every block takes the same
    rows of both, its first RT / 2 row tiles from the gate, the rest from up, and writes one output
    (`Fusion.gated`)."""
    if gated:
        return """  constexpr bool GATED = true;
  constexpr int RTO = RT / 2;
  static_assert(RT % 2 == 0, "a gated launch takes row tiles in pairs");
  const int N = N0, blk = blockIdx.x;
  __nv_bfloat16* out = out0;
  auto tile_w = [&](const int r) { return r < RTO ? w0 : w1; };
  auto tile_scales = [&](const int r) { return r < RTO ? scales0 : scales1; };
  auto tile_biases = [&](const int r) { return r < RTO ? biases0 : biases1; };
"""
    lines = ["  constexpr bool GATED = false;", "  constexpr int RTO = RT;",
             "  const uint32_t* w; const __nv_bfloat16* scales; const __nv_bfloat16* biases; __nv_bfloat16* out;",
             "  int N, blk = blockIdx.x;"]
    for i in range(count):
        test = "" if i == count - 1 else f"if (blk < BLK{i + 1}) "
        lines.append(f"  {'else ' if i else ''}{test}{{ w = w{i}; scales = scales{i}; biases = biases{i}; out = out{i}; "
                     f"N = N{i}; blk -= BLK{i}; }}")
    lines += ["  auto tile_w = [&](const int) { return w; };",
              "  auto tile_scales = [&](const int) { return scales; };",
              "  auto tile_biases = [&](const int) { return biases; };"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Fusion:
    """Work a launch does around its matrix products, which would otherwise be launches of their own:
    `norm`, x is the residual stream and the activations are its RMS norm (input `norm_w`; template EPS;
    each block computes the rows' norms itself); `swiglu`, x is the gate and the activations are
    silu(gate) * up (input `up`); `residual`, one matrix, whose output is added to `residual` (input);
    `gated`, two matrices, an MLP's gate and up projections, and one output, silu(gate) * up;
    `norm_scale`, the RMS norm again (input `norm_w`; template EPS), as the products of x times the norm's
    weight, each row's sums then scaled by its rsqrt(mean(x^2) + eps), whose sum of squares the block
    gathers from the activations it loads anyway;
    `norm_out` (with `residual`), the RMS norm of the launch's output taken for the next launch: it also
    writes its output times the next norm's weight (input `next_norm_w`; output `hw`) and each block's part of
    the output rows' sums of squares (output `ssq_out`); `prenormed`, that next launch: x is `hw`, and each
    row's sums are scaled by rsqrt(sum of the parts (input `ssq_in`) / K + eps) as with `norm_scale`.

    `norm` and `swiglu` work on the input, so every block repeats them over all of it before its first
    product; `norm_scale` adds work to every k-tile; the others work on the block's own output rows."""

    norm: bool = False
    swiglu: bool = False
    residual: bool = False
    gated: bool = False
    norm_scale: bool = False
    norm_out: bool = False
    prenormed: bool = False

    @classmethod
    def of(cls, norm, up, residual, gated: bool = False, norm_scale: bool = False, norm_out=None,
           prenormed=None) -> "Fusion":  # fmt: skip
        """The stages `quantized_matmuls`' arguments ask for (None: not asked)."""
        return cls(norm is not None and not norm_scale, up is not None, residual is not None, gated,
                   norm is not None and norm_scale, norm_out is not None, prenormed is not None)  # fmt: skip

    def inputs(self) -> list[str]:
        return (["norm_w"] * (self.norm or self.norm_scale) + ["up"] * self.swiglu + ["residual"] * self.residual
                + ["next_norm_w"] * self.norm_out + ["ssq_in"] * self.prenormed)  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> "Fusion":
        """Stages by name, comma-separated ('none' or '' for none), as ENGINE_FUSE gives them."""
        names = {n.strip() for n in text.split(",")} - {"", "none"}
        unknown = names - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown GEMV stages {sorted(unknown)} (choose from {', '.join(cls.__dataclass_fields__)})")
        if {"norm", "norm_scale"} <= names:
            raise ValueError("norm and norm_scale are two ways to take the same norm: name one")
        if "prenormed" in names:
            raise ValueError("prenormed is the launch norm_out hands the norm to: name norm_out")
        return cls(**{n: True for n in names})

    def names(self) -> str:
        """The stages that are on, comma-separated ('none' when none): what `parse` reads."""
        return ",".join(n for n in self.__dataclass_fields__ if getattr(self, n)) or "none"

    def tag(self) -> str:
        return ("_n" * self.norm + "_s" * self.swiglu + "_r" * self.residual + "_g" * self.gated + "_ns" * self.norm_scale
                + "_no" * self.norm_out + "_pn" * self.prenormed)  # fmt: skip

    def source(self) -> str:
        """The body's `activations(index, row)` (8 activation values from x[index]) and `output(sum, index)`,
        and the norms' prologue."""
        lines = [_PRENORMED_PREFETCH] if self.prenormed else []
        if self.norm_scale:  # each thread's sum of squares of the activations it loads, per row block
            lines.append("  float ssq[NB];\n  #pragma unroll\n  for (int nb = 0; nb < NB; ++nb) ssq[nb] = 0.0f;")
        if self.norm:
            lines.append("""  __shared__ float rnorm[M];
  for (int m = warp; m < M; m += W) {
    float ss = 0.0f;
    for (int i = lane; i < K / 8; i += 32) {
      ss = engine_sumsq8(__ldg(reinterpret_cast<const uint4*>(x + (size_t)m * K) + i), ss);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) rnorm[m] = rsqrtf(ss / K + __int_as_float(EPS));
  }
  __syncthreads();""")
        lines.append("  auto activations = [&](const size_t i, const int m) -> uint4 {")
        lines.append("    uint4 v = __ldg(reinterpret_cast<const uint4*>(x + i));")
        if self.swiglu:
            lines.append("    const uint4 u = __ldg(reinterpret_cast<const uint4*>(up + i));")
            lines.append("    v = make_uint4(engine_swiglu2(v.x, u.x), engine_swiglu2(v.y, u.y), "
                         "engine_swiglu2(v.z, u.z), engine_swiglu2(v.w, u.w));")
        if self.norm:
            lines.append("    const uint4 w8 = __ldg(reinterpret_cast<const uint4*>(norm_w + i % K));")
            lines.append("    const float r = rnorm[m];")
            lines.append("    v = make_uint4(engine_norm2(v.x, w8.x, r), engine_norm2(v.y, w8.y, r), "
                         "engine_norm2(v.z, w8.z, r), engine_norm2(v.w, w8.w, r));")
        if self.norm_scale:  # row m = g + 8 * nb
            lines.append("    const uint4 w8 = __ldg(reinterpret_cast<const uint4*>(norm_w + i % K));")
            lines.append("    ssq[m >> 3] = engine_sumsq8(v, ssq[m >> 3]);")
            lines.append("    v = make_uint4(engine_mul2(v.x, w8.x), engine_mul2(v.y, w8.y), engine_mul2(v.z, w8.z), "
                         "engine_mul2(v.w, w8.w));")
        lines.append("    return v;\n  };")
        if self.norm_out:  # each output row also times the next norm's weight, its square kept for the block's sum
            lines.append("  __shared__ float sq[16 * RTO][M];")
            lines.append("  auto store = [&](const int rl, const int m, const int row, const __nv_bfloat16 o) {\n"
                         "    out[(size_t)m * N + row] = o;\n    const float f = __bfloat162float(o);\n"
                         "    hw[(size_t)m * N + row] = __float2bfloat16(f * __bfloat162float(next_norm_w[row]));\n"
                         "    sq[rl][m] = f * f;\n  };")
        else:
            lines.append("  auto store = [&](const int, const int m, const int row, const __nv_bfloat16 o) "
                         "{ out[(size_t)m * N + row] = o; };")
        if self.residual:  # the product rounded to bf16, then added to the residual and rounded: as two ops
            lines.append("  auto output = [&](const float v, const float, const size_t i) {\n    return __float2bfloat16("
                         "__bfloat162float(residual[i]) + __bfloat162float(__float2bfloat16(v)));\n  };")
        elif self.gated:  # gate and up rounded to bf16 as their own launches give them, then as engine_swiglu2
            lines.append("  auto output = [&](const float v, const float v_up, const size_t) {\n"
                         "    const float gate = __bfloat162float(__float2bfloat16(v)), up = __bfloat162float(__float2bfloat16(v_up));\n"
                         "    return __float2bfloat16(engine_silu_bf16(gate) * up);\n  };")
        else:
            lines.append("  auto output = [&](const float v, const float, const size_t) { return __float2bfloat16(v); };")
        return "\n".join(lines) + "\n"


# Which of a decode step's norms, SwiGLU and residual adds ride in the GEMV launches (`Fusion`), where the
# fast tier's layer steps ask for them (`layer_launches`). The stages on the output rows are on: H200,
# qwen27b, B = 1, alternating, 101.2 / 102.5 / 68.4 tok/s against 91.5 / 89.1 / 58.2 without, a step's operations other than views 614 against 806
# (reports/gpu/decode-step-epilogues-session10.txt). The stages on the input (norm, swiglu) are off: slower
# in the model (decode-step-fusion-qwen27b.txt). norm_scale (128 fewer launches a qwen27b step, whose RMS
# norms take 0.55 ms of device time: reports/gpu/step-kernels-session11.txt) passes its CUDA test
# (test_norm_scale_takes_the_norm_after_the_products) but is off: under Nsight Compute the launches it joins
# took nearly twice as long (gate+up 70.1 against 43.6 us, DeltaNet inputs 42.0 against 23.1, q/k/v 42.3
# against 22.6), a step's device time 11.2 against 8.8 ms (step-kernels-norm-scale-session12.txt against
# step-kernels-session12.txt; then the eps was an array that made the launches reading it wait: `float_bits`).
# norm_out is on (with residual and gated: the MLP norm taken by the output projection's launch for the
# gate+up launch, and each layer's input norm by the layer before's down launch, `norm_handoff`): 127 fewer
# launches a qwen27b step, no work added to a k-tile. H200, qwen27b, B = 1 under Nsight Compute: 7.52 ms of
# device time a step in 376 kernels against 7.86 in 503 (step-kernels-norm-out-session14.txt against
# step-kernels-session14.txt), 410 graph nodes a step against 537. The decode rate, alternating on the busy
# shared machine (decode-step-norm-out-session14.txt), did not tell them apart: 6 pairs, medians 107 and 107
# tok/s, each side's runs 82-143. ENGINE_FUSE replaces the default (e.g. "residual,gated" without it).
# Set before `engine.kernels.install`, which traces the steps.
FUSE = Fusion.parse(env.fuse_stages()) if env.fuse_stages() is not None \
    else Fusion(residual=True, gated=True, norm_out=True)  # fmt: skip


def launch_bounds(threads: int, min_blocks: int) -> str:
    """Header lines that give the kernel MLX generates next `__launch_bounds__(threads, min_blocks)`:
    MLX writes the signature itself, so `__global__` is redefined (as CUDA's headers define it, plus the
    bounds) for the rest of the source, which holds only this kernel."""
    if not min_blocks:
        return ""
    return f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n"


def kernel_source(count: int, fusion: Fusion = Fusion()) -> str:
    """The kernel's body: which of its `count` matrices a block takes, the fused stages, the loads, the
    products, the sum over warps."""
    start = _BODY_START.replace("  // FUSED STAGES\n", fusion.source())
    scale = _NORM_SCALE_REDUCE if fusion.norm_scale else _PRENORMED_REDUCE if fusion.prenormed else _NO_ROW_SCALE
    reduce = _REDUCE.replace("  // ROW SCALE\n", scale + _NORM_OUT_PROLOGUE * fusion.norm_out)
    reduce = reduce.replace("  // AFTER STORES\n", _NORM_OUT_AFTER * fusion.norm_out)
    return _prologue(count, fusion.gated) + start + _LOAD_REGISTERS + _MULTIPLY + _LOOP_REGISTERS + reduce


def output_names(count: int, fusion: Fusion = Fusion()) -> list[str]:
    """The kernel's outputs: one a matrix (one in all for a gated launch), then norm_out's two."""
    return [f"out{i}" for i in range(1 if fusion.gated else count)] + ["hw", "ssq_out"] * fusion.norm_out


def input_names(count: int, fusion: Fusion = Fusion()) -> list[str]:
    """The kernel's inputs, in the order `launch_arguments` passes them."""
    return ["x"] + [f"{name}{i}" for i in range(count) for name in ("w", "scales", "biases")] + fusion.inputs()


@lru_cache(maxsize=None)
def _kernel(count: int, threads: int = 0, min_blocks: int = 0, fusion: Fusion = Fusion()):
    return cuda_kernel(
        name=f"engine_affine_qmm{count}{fusion.tag()}",
        input_names=input_names(count, fusion),
        output_names=output_names(count, fusion),
        source=kernel_source(count, fusion),
        header=HEADER + launch_bounds(threads, min_blocks),
    )


def tile_k(group_size: int, bits: int) -> int:
    """Input values one k-tile covers: 4 lanes x 1-2 words, inside one group."""
    return 4 * min(group_size * bits // 128, 2) * (32 // bits)


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is laid out on the GPU."""

    warps: int  # warps of a block, splitting K
    row_tiles: int  # 16-row tiles per block
    batch: int  # k-tiles per load batch (U)
    # Blocks an SM must hold at once (0: as many as the registers allow): caps the registers a thread
    # uses, so that a launch's blocks take fewer waves. At M = 1 (4, 2, 4) uses 100 registers (nvcc sm_90),
    # 4 blocks of 128 threads an SM (registers go to a warp in steps of 256), 528 on the H200's 132 SMs:
    # gate+up's 1088 blocks ran as two full waves and one of 32 blocks. At 5 it takes 96, no spills, 660.
    min_blocks: int = 0

    def template(self) -> list[tuple[str, int]]:
        # MINB only names the kernel apart (MLX caches compiled kernels by name and template values).
        return [("W", self.warps), ("RT", self.row_tiles), ("U", self.batch)] + (
            [("MINB", self.min_blocks)] if self.min_blocks else []
        )

    def kernel(self, count: int, fusion: Fusion = Fusion()):
        return _kernel(count, self.warps * 32 if self.min_blocks else 0, self.min_blocks, fusion)

    def setting(self) -> str:
        """'W,RT,U[,MINB]', as an ENGINE_GEMV_LAUNCH item gives it (`parse_launches`)."""
        return ",".join(map(str, [self.warps, self.row_tiles, self.batch] + [self.min_blocks] * bool(self.min_blocks)))


def parse_launches(text: str) -> dict[tuple[int, int], LaunchConfig]:
    """ENGINE_GEMV_LAUNCH's form, 'ROWSxK=W,RT,U[,MINB];...', as {(rows, k): config}."""
    table = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            shape, _, numbers = item.partition("=")
            rows, k = (int(v) for v in shape.lower().split("x"))
            values = [int(v) for v in numbers.split(",")]
            if not 3 <= len(values) <= 4 or min(values[:3]) < 1 or not 1 <= values[0] <= 32 or min(values) < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"ENGINE_GEMV_LAUNCH: {item!r} is not ROWSxK=W,RT,U[,MINB] (warps 1-32)") from None
        table[(rows, k)] = LaunchConfig(*values)
    return table


# One-row launch shapes in place of launch_config's, from ENGINE_GEMV_LAUNCH (for tuning runs on a device)
LAUNCHES = parse_launches(env.gemv_launch() or "")


def launch_config(m: int, k: int, group_size: int, bits: int, rows: int = 0) -> LaunchConfig:
    """Timed on the H200 for qwen27b's shapes, weights cold, 400 calls an evaluation. M = 1 from 64 k-tiles:
    each call adding to the one before, as in a decode step (diag_gemv_configs.py --serial,
    reports/gpu/gemv-configs-serial-session12.json), launches of up to 8192 rows are fastest at (8, 1, 4):
    5120x17408 30.3 us against 42.2 at (4, 2, 4), 5120x6144 15.1 against 16.9, 6144x5120 13.3 against 15.6
    (their few blocks leave SMs idle; more warps a block keep more loads in flight); in the model, under Nsight
    Compute, the down projection went from 41.2 to 28.0 us and o_proj / out from 15.3 to 12.5
    (step-kernels-session12.txt). Larger launches take (4, 1, 4), and (4, 2, 4) from 32 MB of 4-bit weights
    (`rows` in all the launch's matrices x k), as timed with independent calls (gemv-configs-m1-400-qwen27b.txt;
    the serial sweep has 17408x5120 at 27.0 us with one row tile against 28.6 with two), capped at five blocks
    an SM (`LaunchConfig.min_blocks`): in the serial sweep faster on every qwen27b shape than uncapped
    (17408x5120 22.9 us against 29.9, its 544 blocks one wave instead of 528 and 16; the head 214.9 against
    224.2; gemv-configs-b5-session15.txt), and in the model under Nsight Compute gate+up 38.3 us against 44.7
    (a step 7.31 ms against 7.56; step-kernels-gated-b5-session15.txt). The DeltaNet inputs' and q/k/v's
    launches, one wave either way, take the cap too (not timed in the model); so do 8-bit and group-32
    weights, which nvcc fits in 96 registers without spills (not timed). M = 8 at (4, 2, 4)
    for K = 17408 and (4, 2, 8) for K = 5120 (gemv-configs-qwen27b.txt). M = 2..4 keep the earlier M <= 4
    choices, not timed since. ENGINE_GEMV_LAUNCH replaces the one-row choice for given shapes (LAUNCHES)."""
    if m == 1 and (rows, k) in LAUNCHES:
        return LAUNCHES[(rows, k)]
    tiles = k // tile_k(group_size, bits)
    if tiles >= 64 and m == 1:
        if rows <= 8192:
            return LaunchConfig(8, 1, 4)
        return LaunchConfig(4, 2, 4, 5) if rows * k >= 64 << 20 else LaunchConfig(4, 1, 4)
    if tiles >= 256:
        return LaunchConfig(2, 1, 4) if m <= 4 else LaunchConfig(4, 2, 4)
    if tiles >= 64:
        return LaunchConfig(4, 2, 4) if m <= 4 else LaunchConfig(4, 2, 8)
    return LaunchConfig(2 if tiles >= 16 else 1, 1, 4)


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


def quantized_matmuls(
    x: mx.array,
    matrices: Sequence[tuple[mx.array, mx.array, mx.array]],
    group_size: int,
    bits: int,
    config: Optional[LaunchConfig] = None,
    *,
    norm: Optional[tuple[mx.array, float]] = None,
    up: Optional[mx.array] = None,
    residual: Optional[mx.array] = None,
    gated: bool = False,
    norm_scale: bool = False,
    norm_out: Optional[mx.array] = None,
    prenormed: Optional[tuple[mx.array, float]] = None,
) -> list[mx.array]:
    """x [..., K] bf16 times each quantized [N_i, K] matrix (weight, scales, biases), transposed, in one
    launch: [..., N_i] bf16 each (CUDA only). Each result equals `quantized_matmul`'s for that matrix alone.
    `config` overrides `launch_config`. In the same launch (`Fusion`), to rounding what the separate
    operations give: `norm` (weight [K], eps) multiplies by the RMS norm of x, i.e.
    `mx.fast.rms_norm(x, weight, eps)`; `up` takes `silu(x) * up` for x; `residual` ([..., N], one
    matrix) is added to the product; `gated` (two matrices of equal rows, gate and up) gives one result,
    silu(gate product) * up product, i.e. `swiglu` of the two results; `norm_scale` (with `norm`) takes
    the norm as `Fusion.norm_scale` does, after the products instead of before them. `norm_out` (the next
    norm's weight [N], one matrix) adds two results for the launch that takes that norm: the result times
    the weight ([..., N] bf16) and the blocks' parts of each row's sum of squares ([M, blocks] float32);
    `prenormed` (those parts, the norm's eps) is that launch, x being the result times the weight: together
    `Fusion.norm_out` and `Fusion.prenormed`, i.e. `norm=(weight, eps), norm_scale=True` on the first
    launch's result, to rounding."""
    k = x.shape[-1]
    m = x.size // k
    config = config or launch_config(m, k, group_size, bits, sum(w.shape[0] for w, _, _ in matrices))
    if norm_scale and norm is None:
        raise ValueError("norm_scale takes the norm's weight and eps (norm=)")
    fusion = Fusion.of(norm, up, residual, gated, norm_scale, norm_out, prenormed)
    if (fusion.residual or fusion.norm_out) and len(matrices) != 1:
        raise ValueError("a residual or norm_out goes with one matrix")
    if norm_out is not None and norm_out.shape != (matrices[0][0].shape[0],):
        raise ValueError(f"norm_out: the next norm's weight is {norm_out.shape}, not one value a row")
    if prenormed is not None and (norm is not None or up is not None or prenormed[0].dtype != mx.float32
                                  or prenormed[0].ndim != 2 or prenormed[0].shape[0] != m):  # fmt: skip
        raise ValueError("prenormed takes float32 parts [M, blocks] of the sums of squares, and no norm or up")
    if gated:
        if len(matrices) != 2 or matrices[0][0].shape != matrices[1][0].shape or fusion.residual or fusion.norm_out:
            raise ValueError("a gated launch takes two matrices of one shape (gate, up) and no residual")
        config = replace(config, row_tiles=config.row_tiles + config.row_tiles % 2)  # tiles in pairs
    # The kernel reads its inputs as flat rows and writes results of x's leading shape: no reshapes, which
    # would be graph nodes the host handles at every decode step (~4 a launch, 300 launches).
    extra = _stage_arrays(norm, up, residual, norm_out, prenormed)
    args = launch_arguments(x, matrices, group_size, bits, config, extra, fusion,
                            prenormed[0].shape[-1] if prenormed else 0, _norm_eps(norm, prenormed))  # fmt: skip
    return config.kernel(len(matrices), fusion)(**args)


def float_bits(value: float) -> int:
    """A float32's bits as a signed int: how a kernel takes a constant float (`__int_as_float`) as a template
    value. As an input, a one-value float32 array lives in MLX's CUDA pool for arrays of up to 8 bytes:
    managed memory advised read-mostly, which the host writes whenever it makes a small array and reads for
    every sampled token, so a kernel reading from it can wait for its page to come back. H200, qwen27b,
    B = 1 under Nsight Compute: with eps as an array, the launches that read it took 11-15 us longer at
    every size (gate+up 51.9 us, DeltaNet inputs 35.0, q/k/v 34.7; the DeltaNet step kernel, its two eps
    in one 8-byte array, 14.3; reports/gpu/step-kernels-norm-out-eps-array-session14.txt); as template
    values 42.6, 20.9, 20.5 and 7.9 (step-kernels-norm-out-session14.txt)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def launch_arguments(x: mx.array, matrices: Sequence[tuple[mx.array, mx.array, mx.array]], group_size: int, bits: int,
                     config: LaunchConfig, extra: Sequence[mx.array] = (), fusion: Fusion = Fusion(),
                     parts: int = 0, eps: float = 0.0) -> dict:  # fmt: skip
    """The kernel call's arguments for x [..., K] (M rows in all) and the matrices, each result [..., N_i]:
    blocks matrix after matrix, matrix i's from block BLK{i}, one block per 16 * row_tiles rows. A gated
    launch: one block per 16 * row_tiles / 2 rows of both matrices, one result. norm_out: its two results
    after the product (`output_names`); prenormed: `parts` sums of squares a row in its input (template P).
    A norm's `eps` is a template value (EPS, its float32 bits), not an input: see `float_bits`."""
    k = x.shape[-1]
    m = x.size // k
    rows = [w.shape[0] for w, _, _ in matrices]
    starts = [0]
    for n in rows[:1] if fusion.gated else rows:
        tile_rows = 16 * config.row_tiles // (2 if fusion.gated else 1)
        starts.append(starts[-1] + (n + tile_rows - 1) // tile_rows)
    products = len(starts) - 1
    norm_out = fusion.norm_out * [(*x.shape[:-1], rows[0]), (m, starts[-1])]
    return dict(
        inputs=[x] + [a for triple in matrices for a in triple] + list(extra),
        template=[("K", k), ("M", m), ("BITS", bits), ("GS", group_size)] + config.template()
                 + [(f"N{i}", n) for i, n in enumerate(rows)] + [(f"BLK{i}", b) for i, b in enumerate(starts[:-1])]
                 + fusion.prenormed * [("P", parts)]
                 + (fusion.norm or fusion.norm_scale or fusion.prenormed) * [("EPS", float_bits(eps))],
        grid=(starts[-1] * config.warps * 32, 1, 1),
        threadgroup=(config.warps * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n) for n in rows[:products]] + norm_out,
        output_dtypes=[mx.bfloat16] * products + fusion.norm_out * [mx.bfloat16, mx.float32],
    )  # fmt: skip


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    config: Optional[LaunchConfig] = None,
) -> mx.array:
    """x [..., K] bf16 times the quantized [N, K] matrix, transposed: [..., N] bf16 (CUDA only)."""
    return quantized_matmuls(x, [(w, scales, biases)], group_size, bits, config)[0]


@lru_cache(maxsize=None)
def _compiled(group_size: int, bits: int, count: int = 1, fusion: Fusion = Fusion(), eps: float = 0.0):
    # Traced once per input shape: later calls skip building the kernel call (template list, source
    # text) on the host: ~10 us a call uncompiled, ~2 compiled (reports/gpu/launch-overhead.txt), at
    # hundreds of calls per decode step of a 27B model.
    def run(x, *arrays):
        triples = [arrays[i : i + 3] for i in range(0, 3 * count, 3)]
        extra = list(arrays[3 * count :])
        norm = (extra.pop(0), eps) if fusion.norm or fusion.norm_scale else None
        up = extra.pop(0) if fusion.swiglu else None
        residual = extra.pop(0) if fusion.residual else None
        norm_out = extra.pop(0) if fusion.norm_out else None
        prenormed = (extra.pop(0), eps) if fusion.prenormed else None
        return quantized_matmuls(x, triples, group_size, bits, norm=norm, up=up, residual=residual, gated=fusion.gated,
                                 norm_scale=fusion.norm_scale, norm_out=norm_out, prenormed=prenormed)  # fmt: skip

    return mx.compile(run)


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
        new.groupable = use_kernel and new.kernel_refusal is None  # may share one launch with other layers
        if new.kernel_refusal is None and q["weight"].shape[0] < LAYER_MIN_OUTPUTS:
            new.kernel_refusal = f"{q['weight'].shape[0]} outputs (MLX's kernel is faster below {LAYER_MIN_OUTPUTS})"
        new.use_kernel = use_kernel and new.kernel_refusal is None
        new.dense_prefill = (
            use_kernel and q.mode == "affine" and q["weight"].shape[0] >= DENSE_MIN_OUTPUTS
            and q["scales"].dtype in DENSE_DTYPES
        )  # fmt: skip
        return new

    def __call__(self, x: mx.array) -> mx.array:
        if self.dense_prefill and DENSE_MIN_ROWS is not None and x.size >= DENSE_MIN_ROWS * x.shape[-1]:
            y = dense_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
            return _with_bias(y, self)
        if not self.use_kernel or not _takes(x, self):
            return super().__call__(x)
        return run_kernel(x, [self])[0]

    @staticmethod
    def project_together(x: mx.array, layers: Sequence[nn.Module]) -> tuple[mx.array, ...]:
        """Each layer applied to x, in one launch where the kernel takes them all (the projections that
        share an input: gate and up, q/k/v, a DeltaNet's inputs); small ones then ride along with the rest."""
        together = len(layers) > 1 and one_launch(x, layers)
        return run_kernel(x, layers) if together else tuple(q(x) for q in layers)


def one_launch(x: mx.array, layers: Sequence[nn.Module]) -> bool:
    """Whether the kernel takes all the layers with x in one launch (same bits and group size, enough rows)."""
    first = layers[0]
    return (
        all(getattr(q, "groupable", False) and (q.group_size, q.bits) == (first.group_size, first.bits)
            and _takes(x, q) for q in layers)
        and sum(q["weight"].shape[0] for q in layers) >= LAYER_MIN_OUTPUTS
    )  # fmt: skip


def no_bias(layers: Sequence[nn.Module]) -> bool:
    """Whether none of the layers adds a bias: a launch's fused stages work on its bare products (`run_kernel` adds
    a bias only to a result the launch returns)."""
    return not any("bias" in q for q in layers)


def dense_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)` as the weights dequantized to their
    scales' dtype, then one matrix multiply (cuBLAS on CUDA).
    For a prompt chunk the GEMM runs near the tensor cores' rate, and the dequantized copy (one matrix at
    a time, freed after) costs a pass over memory. On the H200 the result equalled MLX's quantized matmul
    bit for bit on every qwen27b shape of at least 1024 rows at M = 1023 (MLX's CUDA kernel rounds the
    dequantized weights to bf16 too); that is measured, not promised, so this belongs to the fast tier."""
    return x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T


def run_kernel(x: mx.array, layers: Sequence[nn.QuantizedLinear], norm: Optional[tuple[mx.array, float]] = None,
               up: Optional[mx.array] = None, residual: Optional[mx.array] = None, gated: bool = False,
               norm_scale: bool = False, norm_out: Optional[mx.array] = None,
               prenormed: Optional[tuple[mx.array, float]] = None) -> tuple[mx.array, ...]:  # fmt: skip
    """The layers (same bits and group size) applied to x in one compiled launch, biases added (the fused
    stages take layers without bias), then norm_out's two results where asked."""
    first = layers[0]
    arrays = [q[name] for q in layers for name in ("weight", "scales", "biases")]
    fusion = Fusion.of(norm, up, residual, gated, norm_scale, norm_out, prenormed)
    extra = _stage_arrays(norm, up, residual, norm_out, prenormed)  # eps is a constant of the trace
    run = _compiled(first.group_size, first.bits, len(layers), fusion, _norm_eps(norm, prenormed))
    ys = run(x, *arrays, *extra)
    return tuple(_with_bias(y, q) for y, q in zip(ys, layers)) + tuple(ys[len(layers) :])


def _norm_eps(norm: Optional[tuple[mx.array, float]], prenormed: Optional[tuple[mx.array, float]]) -> float:
    """The eps of the norm a launch takes (`norm` or `prenormed`; 0.0 for none)."""
    return (norm or prenormed or (None, 0.0))[1]


def _stage_arrays(norm: Optional[tuple[mx.array, float]], up: Optional[mx.array], residual: Optional[mx.array],
                  norm_out: Optional[mx.array], prenormed: Optional[tuple[mx.array, float]]) -> list[mx.array]:  # fmt: skip
    """The fused stages' input arrays that are asked for (None: not asked), in `Fusion.inputs`' order: what
    the kernel call and `_compiled`'s `run` take after the matrices."""
    arrays = (norm and norm[0], up, residual, norm_out, prenormed and prenormed[0])
    return [a for a in arrays if a is not None]


def _with_bias(y: mx.array, q: nn.QuantizedLinear) -> mx.array:
    return y + q["bias"] if "bias" in q else y


def _takes(x: mx.array, q: nn.QuantizedLinear) -> bool:
    """Whether the kernel computes q(x): bf16 activations, at most LAYER_MAX_ROWS rows, q's input size."""
    k = x.shape[-1]
    return x.dtype == mx.bfloat16 and x.size <= LAYER_MAX_ROWS * k and q["weight"].shape[1] * 32 // q.bits == k
