"""A Gated DeltaNet layer's one-token core as one CUDA kernel.

What `gated_delta_decode._core` computes between a DeltaNet layer's input
and output projections, for one token: the depthwise causal conv over the
last K positions and its SiLU, the conv tail update, q/k L2 normalization,
the decay and beta gates, the delta-rule state update and readout, and the
gated RMS norm. Compiled with `mx.compile`, that core is still ~20 operations
(reductions and state-sized temporaries MLX does not fuse), each a launch the
host pays a few microseconds for; here it is one launch per layer, and the
state (float32, or bfloat16 or float16 with the math in float32) is read and written once.

One block per (batch row, value head). Its first threads take a value
channel each: they compute the heads' q and k channels (recomputed by each
value head of a key head's group: 2 x 128 multiply-adds) and the v channels.
For the delta rule each warp takes several state rows at once with its lanes
across the key dimension (`launch_shape`): at qwen27b's heads a block of 512
threads holds the head's whole 64 KB state in registers after one round of
loads, issued at the kernel's start so that they overlap the conv: a step
reads and writes 3.1 MB of state, so the loads' latency, not bandwidth, sets
its time (docs/kernels.md). Each row's sums run in the same order however
the rows are dealt out. The
roundings of the compiled core are kept where it rounds to bf16 (the conv
output, the normalized q and k, y before the norm, the norm before the
gate), so the two agree to float32 summation order.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.kernels.cuda_source import cuda_kernel
from engine.kernels.quantized_gemv import float_bits, launch_bounds

HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
__device__ __forceinline__ bool engine_is_bf16(const __nv_bfloat16*) { return true; }
__device__ __forceinline__ bool engine_is_bf16(const float*) { return false; }
__device__ __forceinline__ void engine_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void engine_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void engine_store(__half* p, float v) { *p = __float2half(v); }
"""

SOURCE = r"""
  // Block (b, h): batch row b, value head h; thread t: value channel t (and key channel t for q and k).
  const int b = blockIdx.x / HV, h = blockIdx.x % HV;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  constexpr int KD = HK * DK;           // key channels; conv channels are q (KD), k (KD), v (HV * DV)
  constexpr int C = 2 * KD + HV * DV;
  constexpr int GROUP = HV / HK;        // value heads per key head
  constexpr int NW = NT / 32;           // warps: the first DV / 32 hold a value channel a thread
  constexpr int VW = DV / 32;
  constexpr int ROUNDS = DV / (RB * NW);
  static_assert(DV % (RB * NW) == 0, "the state's rows in rounds of RB a warp");
  const int hk = h / GROUP;
  __shared__ float qs[DK], ks[DK], vs[DV], red[2][NW];

  // The delta rule's state rows: warp w takes rows w + NW * r (r < RB) in each round, lanes across the key
  // dimension. The first round's loads are issued here, before the conv, so their latency overlaps it.
  const auto* s_in = state + ((size_t)b * HV + h) * DV * DK;  // float or bf16: the math is float32 either way
  auto* s_out = new_state + ((size_t)b * HV + h) * DV * DK;
  float s[RB][DK / 32];
  auto load_rows = [&](const int i0) {
    #pragma unroll
    for (int r = 0; r < RB; ++r)
      #pragma unroll
      for (int j = 0; j < DK / 32; ++j) s[r][j] = (float)s_in[(size_t)(i0 + r * NW) * DK + lane + 32 * j];
  };
  load_rows(warp);

  auto conv = [&](int c) -> float {     // depthwise conv over the K - 1 stored positions and the new one, SiLU
    float acc = 0.0f;
    #pragma unroll
    for (int j = 0; j < KS - 1; ++j)
      acc += (float)conv_state[((size_t)b * (KS - 1) + j) * C + c] * (float)conv_w[(size_t)c * KS + j];
    acc += (float)qkv[(size_t)b * C + c] * (float)conv_w[(size_t)c * KS + KS - 1];
    return __bfloat162float(__float2bfloat16(acc / (1.0f + __expf(-acc))));
  };
  auto shift = [&](int c) {             // the conv tail: the last K - 1 positions, the new one at the end
    #pragma unroll
    for (int j = 0; j < KS - 2; ++j)
      new_conv[((size_t)b * (KS - 1) + j) * C + c] = conv_state[((size_t)b * (KS - 1) + j + 1) * C + c];
    new_conv[((size_t)b * (KS - 1) + KS - 2) * C + c] = qkv[(size_t)b * C + c];
  };
  auto block_sum = [&](float v, int slot) -> float {  // sum over the first DV threads (the rest pass 0)
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[slot][warp] = v;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int w = 0; w < VW; ++w) total += red[slot][w];
    return total;
  };

  if (t < DK) {
    qs[t] = conv(hk * DK + t);
    ks[t] = conv(KD + hk * DK + t);
    if (h % GROUP == 0) { shift(hk * DK + t); shift(KD + hk * DK + t); }
  }
  if (t < DV) {
    vs[t] = conv(2 * KD + h * DV + t);
    shift(2 * KD + h * DV + t);
  }
  __syncthreads();

  // q, k: RMS-normalized (eps folded as the compiled core does), times Dk^-1 and Dk^-0.5, rounded to bf16 twice
  {
    const float inv = rsqrtf((float)DK);
    const float qv = t < DK ? qs[t] : 0.0f, kv = t < DK ? ks[t] : 0.0f;
    const float qss = block_sum(qv * qv, 0), kss = block_sum(kv * kv, 1);
    const float eps = __int_as_float(QK_EPS) * inv * inv;
    if (t < DK) {  // each thread reads and writes only its own channel here
      const float qn = __bfloat162float(__float2bfloat16(qv * rsqrtf(qss / DK + eps)));
      const float kn = __bfloat162float(__float2bfloat16(kv * rsqrtf(kss / DK + eps)));
      qs[t] = __bfloat162float(__float2bfloat16(qn * inv * inv));
      ks[t] = __bfloat162float(__float2bfloat16(kn * inv));
    }
  }
  __syncthreads();

  // gates: g = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b); a + dt_bias and its softplus
  // are bf16 in the compiled core when dt_bias is
  const bool bf16_bias = engine_is_bf16(dt_bias);
  auto round_like_bias = [&](float x) { return bf16_bias ? __bfloat162float(__float2bfloat16(x)) : x; };
  const float av = round_like_bias((float)a[(size_t)b * HV + h] + (float)dt_bias[h]);
  const float sp = round_like_bias(av > 20.0f ? av : log1pf(__expf(av)));
  const float g = __expf(-__expf((float)A_log[h]) * sp);
  const float bl = (float)beta_logits[(size_t)b * HV + h];
  const float beta = __bfloat162float(__float2bfloat16(1.0f / (1.0f + __expf(-bl))));

  // the delta rule, RB rows of a warp at a time so their loads and reductions overlap; each row's sums run
  // in the same order however the rows are dealt out
  for (int round = 0; round < ROUNDS; ++round) {
    const int i0 = warp + round * RB * NW;
    if (round > 0) load_rows(i0);
    float kv_mem[RB], y[RB];
    #pragma unroll
    for (int r = 0; r < RB; ++r) {
      kv_mem[r] = 0.0f;
      #pragma unroll
      for (int j = 0; j < DK / 32; ++j) {
        s[r][j] *= g;
        kv_mem[r] += s[r][j] * ks[lane + 32 * j];
      }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      #pragma unroll
      for (int r = 0; r < RB; ++r) kv_mem[r] += __shfl_xor_sync(0xffffffffu, kv_mem[r], o);
    }
    #pragma unroll
    for (int r = 0; r < RB; ++r) {
      const int i = i0 + r * NW;
      const float delta = (vs[i] - kv_mem[r]) * beta;
      y[r] = 0.0f;
      #pragma unroll
      for (int j = 0; j < DK / 32; ++j) {
        s[r][j] += ks[lane + 32 * j] * delta;
        engine_store(&s_out[(size_t)i * DK + lane + 32 * j], s[r][j]);
        y[r] += s[r][j] * qs[lane + 32 * j];
      }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      #pragma unroll
      for (int r = 0; r < RB; ++r) y[r] += __shfl_xor_sync(0xffffffffu, y[r], o);
    }
    if (lane == 0) {
      #pragma unroll
      for (int r = 0; r < RB; ++r) vs[i0 + r * NW] = __bfloat162float(__float2bfloat16(y[r]));  // v no longer needed
    }
  }
  __syncthreads();

  // gated RMS norm: bf16(y * rsqrt(mean(y^2) + eps) * w), then silu(z) times it, in float32
  const float y = t < DV ? vs[t] : 0.0f;
  const float yss = block_sum(y * y, 0);
  if (t < DV) {
    const float rn = rsqrtf(yss / DV + __int_as_float(NORM_EPS));
    const float normed = __bfloat162float(__float2bfloat16(y * rn * (float)norm_w[t]));
    const float zv = (float)z[((size_t)b * HV + h) * DV + t];
    out[((size_t)b * HV + h) * DV + t] = __float2bfloat16(zv / (1.0f + __expf(-zv)) * normed);
  }
"""


@cache
def _kernel(threads: int):
    # The bounds cap a thread at 64 registers, so that 1024 threads fit an SM: two blocks of 512 at qwen27b's
    # heads (Nsight Compute at 64 rows: 70 registers held it to one block, 25% occupancy, 1.8 TB/s; nvcc
    # gives 64 without spills). Registers change no arithmetic: the bits stay.
    return cuda_kernel(
        name=f"engine_gated_delta_step_{threads}",
        input_names=["qkv", "conv_state", "conv_w", "z", "a", "beta_logits", "A_log", "dt_bias", "norm_w", "state"],
        output_names=["out", "new_conv", "new_state"],
        source=SOURCE,
        header=HEADER + launch_bounds(threads, max(1, 1024 // threads)),
    )


def refusal(dk: int, dv: int) -> str | None:
    """Why the kernel cannot run heads of key dim `dk` and value dim `dv` (None when it can): a thread per
    value channel also computes the key channel of the same index, and lanes split the key dimension."""
    if dk > dv or dk % 32 or dv % 32 or dv > 1024:
        return f"key dim {dk} and value dim {dv}: both multiples of 32, key <= value <= 1024"
    return None


def launch_shape(dk: int, dv: int) -> tuple[int, int]:
    """(threads of a block, state rows a warp takes at once): up to 4 threads per value channel, up to 512
    in all (at least one per channel), and as many rows as keep a warp's share of them in 32 registers a
    thread, so at qwen27b's heads (128 x 128) the 16 warps of a block load the head's whole state at once."""
    per_channel = max(1, min(4, 512 // dv))
    rows = 32 // per_channel
    while rows > 1 and rows * dk > 1024:
        rows //= 2
    return dv * per_channel, rows


def delta_step(
    qkv,
    z,
    a,
    beta_logits,
    conv_state,
    state,
    conv_w,
    A_log,
    dt_bias,
    norm_w,
    norm_eps: float,
    heads_k: int,
    dk: int,
    qk_eps: float = 1e-6,
):
    """The arguments and results of `gated_delta_decode._core` (qkv [B, 1, C], z [B, 1, Hv * Dv], a and
    beta_logits [B, 1, Hv], conv_state [B, K - 1, C], state [B, Hv, Dv, Dk], conv_w [C, K, 1]):
    (out [B, 1, Hv * Dv] bf16, new conv_state, new state). CUDA only; Dk <= Dv, both multiples of 32 (a
    thread per value channel computes the key channel of the same index). The kernel reads its inputs as
    flat arrays, so none is reshaped (a reshape is a graph node the host handles every step)."""
    batch, hv, dv, _ = state.shape
    why = refusal(dk, dv)
    if why:
        raise ValueError(why)
    ks = conv_w.shape[1]
    threads, rows = launch_shape(dk, dv)
    out, new_conv, new_state = _kernel(threads)(
        inputs=[qkv, conv_state, conv_w, z, a, beta_logits, A_log, dt_bias, norm_w, state],
        template=[
            ("HK", heads_k),
            ("HV", hv),
            ("DK", dk),
            ("DV", dv),
            ("KS", ks),
            ("NT", threads),
            ("RB", rows),
            ("QK_EPS", float_bits(qk_eps)),
            ("NORM_EPS", float_bits(norm_eps)),
        ],  # not inputs: see float_bits
        grid=(batch * hv * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(batch, 1, hv * dv), conv_state.shape, state.shape],
        output_dtypes=[mx.bfloat16, conv_state.dtype, state.dtype],
    )
    return out, new_conv, new_state
