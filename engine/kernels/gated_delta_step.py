"""A Gated DeltaNet layer's one-token core as one CUDA kernel.

What `gated_delta_decode._core` computes between a DeltaNet layer's input
and output projections, for one token: the depthwise causal conv over the
last K positions and its SiLU, the conv tail update, q/k L2 normalization,
the decay and beta gates, the delta-rule state update and readout, and the
gated RMS norm. Compiled with `mx.compile`, that core is still ~20 operations
(reductions and state-sized temporaries MLX does not fuse), each a launch the
host pays a few microseconds for; here it is one launch per layer, and the
state (float32, or bfloat16 or float16 with the math in float32) is read and written once.

One block per (batch row, value head). Its threads take the block's conv
channels one each (q and k of its key head, recomputed by each value head of
the group, then v), its last value-dim threads the gated norm, and for the
delta rule each warp takes several state rows at once with its lanes across
the key dimension (`launch_shape`): at qwen27b's heads a block of 512
threads holds the head's whole 64 KB state in registers after one round of
loads. Every global read (the state, the conv's inputs and weights, the
gates, z and the norm's weights) is issued at the kernel's start, before
any write, so a block waits for memory once, not once a phase: at 64 rows
the state's 400 MB a layer move as fast as blocks turn over (docs/kernels.md).
Each row's sums run in the same order however the rows are dealt out. The
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
template <typename T> __device__ __forceinline__ const T* engine_as(const unsigned char* p, const T*) {
  return reinterpret_cast<const T*>(p);
}
"""

SOURCE = r"""
  // Block (b, h): batch row b, value head h. Every global read is issued at the start, before any write (the
  // state rows, the conv's inputs and weights, the gates, z and the norm's weights), so that one memory latency,
  // not one a phase, sets a block's time: at 64 rows and more, what decides how fast the blocks turn over.
  const int b = blockIdx.x / HV, h = blockIdx.x % HV;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  constexpr int KD = HK * DK;           // key channels; conv channels are q (KD), k (KD), v (HV * DV)
  constexpr int C = 2 * KD + HV * DV;
  constexpr int GROUP = HV / HK;        // value heads per key head
  constexpr int NW = NT / 32;
  constexpr int VW = DV / 32;
  constexpr int OUT0 = NT - DV;         // the last DV threads hold a value channel each for the gated norm
  constexpr int ROUNDS = DV / (RB * NW);
  constexpr int SLOTS = 2 * DK + DV;    // the block's conv channels: q and k of its key head, v of its value head
  constexpr int US = (SLOTS + NT - 1) / NT;  // conv channels a thread takes (slots t, t + NT, ...)
  static_assert(DV % (RB * NW) == 0, "the state's rows in rounds of RB a warp");
  const int hk = h / GROUP;
  __shared__ float qs[DK], ks[DK], vs[DV], red[2][NW], gates[2];

  // The delta rule's state rows: warp w takes rows w + NW * r (r < RB) in each round, lanes across the key
  // dimension.
  const auto* s_in = state + ((size_t)b * HV + h) * DV * DK;  // float or bf16: the math is float32 either way
  auto* s_out = new_state + ((size_t)b * HV + h) * DV * DK;
  // SS: the state is copied whole into shared memory (cp.async, before anything else) and read from there in
  // rounds of RB rows a warp, so a thread holds a few rows' values, not the head's share: more blocks an SM,
  // more heads' states in flight. Else the rows come from global memory into registers, the first round here.
  extern __shared__ __align__(16) unsigned char engine_state_sh[];
  const auto* s_sh = engine_as(engine_state_sh, state);
  if constexpr (SS) {
    constexpr int COPIES = DV * DK * (int)sizeof(*state) / 16;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(s_in);
    #pragma unroll
    for (int c = t; c < COPIES; c += NT) {
      const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(engine_state_sh + 16 * c));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src + 16 * (size_t)c) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  float s[RB][DK / 32];
  auto load_rows = [&](const int i0) {
    #pragma unroll
    for (int r = 0; r < RB; ++r)
      #pragma unroll
      for (int j = 0; j < DK / 32; ++j) {
        const size_t at = (size_t)(i0 + r * NW) * DK + lane + 32 * j;
        s[r][j] = SS ? (float)s_sh[at] : (float)s_in[at];
      }
  };
  if constexpr (!SS) load_rows(warp);

  // conv slot u: q channel u, k channel u - DK, v channel u - 2 DK; its K - 1 stored positions and the new one
  auto channel = [&](int u) {
    return u < DK ? hk * DK + u : u < 2 * DK ? KD + hk * DK + u - DK : 2 * KD + h * DV + u - 2 * DK;
  };
  float cin[US][KS], cw[US][KS];
  #pragma unroll
  for (int i = 0; i < US; ++i) {
    const int u = t + i * NT;
    if (u < SLOTS) {
      const int c = channel(u);
      #pragma unroll
      for (int j = 0; j < KS - 1; ++j) cin[i][j] = (float)conv_state[((size_t)b * (KS - 1) + j) * C + c];
      cin[i][KS - 1] = (float)qkv[(size_t)b * C + c];
      #pragma unroll
      for (int j = 0; j < KS; ++j) cw[i][j] = (float)conv_w[(size_t)c * KS + j];
    }
  }
  float av = 0.0f, dtb = 0.0f, alog = 0.0f, bl = 0.0f, zv = 0.0f, nw = 0.0f;
  if (t == NT - 1) {
    av = (float)a[(size_t)b * HV + h];
    dtb = (float)dt_bias[h];
    alog = (float)A_log[h];
    bl = (float)beta_logits[(size_t)b * HV + h];
  }
  if (t >= OUT0) {
    zv = (float)z[((size_t)b * HV + h) * DV + t - OUT0];
    nw = (float)norm_w[t - OUT0];
  }

  // the depthwise conv over the positions and its SiLU, rounded to bf16; the conv tail takes the last K - 1
  // positions, the new one at the end (q and k written by the first value head of their group)
  #pragma unroll
  for (int i = 0; i < US; ++i) {
    const int u = t + i * NT;
    if (u < SLOTS) {
      float acc = 0.0f;
      #pragma unroll
      for (int j = 0; j < KS; ++j) acc += cin[i][j] * cw[i][j];
      const float x = __bfloat162float(__float2bfloat16(acc / (1.0f + __expf(-acc))));
      if (u < DK) qs[u] = x; else if (u < 2 * DK) ks[u - DK] = x; else vs[u - 2 * DK] = x;
      if (u >= 2 * DK || h % GROUP == 0) {
        const int c = channel(u);
        #pragma unroll
        for (int j = 0; j < KS - 1; ++j) engine_store(&new_conv[((size_t)b * (KS - 1) + j) * C + c], cin[i][j + 1]);
      }
    }
  }
  // gates: g = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b); a + dt_bias and its softplus
  // are bf16 in the compiled core when dt_bias is
  if (t == NT - 1) {
    const bool bf16_bias = engine_is_bf16(dt_bias);
    auto round_like_bias = [&](float x) { return bf16_bias ? __bfloat162float(__float2bfloat16(x)) : x; };
    const float ab = round_like_bias(av + dtb);
    const float sp = round_like_bias(ab > 20.0f ? ab : log1pf(__expf(ab)));
    gates[0] = __expf(-__expf(alog) * sp);
    gates[1] = __bfloat162float(__float2bfloat16(1.0f / (1.0f + __expf(-bl))));
  }
  auto block_sum = [&](float v, int slot, int first_warp) -> float {  // over VW warps from first_warp
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[slot][warp] = v;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int w = 0; w < VW; ++w) total += red[slot][first_warp + w];
    return total;
  };
  __syncthreads();

  // q, k: RMS-normalized (eps folded as the compiled core does), times Dk^-1 and Dk^-0.5, rounded to bf16 twice
  {
    const float inv = rsqrtf((float)DK);
    const float qv = t < DK ? qs[t] : 0.0f, kv = t < DK ? ks[t] : 0.0f;
    const float qss = block_sum(qv * qv, 0, 0), kss = block_sum(kv * kv, 1, 0);
    const float eps = __int_as_float(QK_EPS) * inv * inv;
    if (t < DK) {  // each thread reads and writes only its own channel here
      const float qn = __bfloat162float(__float2bfloat16(qv * rsqrtf(qss / DK + eps)));
      const float kn = __bfloat162float(__float2bfloat16(kv * rsqrtf(kss / DK + eps)));
      qs[t] = __bfloat162float(__float2bfloat16(qn * inv * inv));
      ks[t] = __bfloat162float(__float2bfloat16(kn * inv));
    }
  }
  if constexpr (SS) asm volatile("cp.async.wait_all;" ::: "memory");  // then the barrier: every copy landed
  __syncthreads();
  const float g = gates[0], beta = gates[1];

  // the delta rule, RB rows of a warp at a time so their loads and reductions overlap; each row's sums run
  // in the same order however the rows are dealt out
  for (int round = 0; round < ROUNDS; ++round) {
    const int i0 = warp + round * RB * NW;
    if (SS || round > 0) load_rows(i0);
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

  // gated RMS norm over the last DV threads: bf16(y * rsqrt(mean(y^2) + eps) * w), then silu(z) times it
  const float y = t >= OUT0 ? vs[t - OUT0] : 0.0f;
  const float yss = block_sum(y * y, 0, OUT0 / 32);
  if (t >= OUT0) {
    const float rn = rsqrtf(yss / DV + __int_as_float(NORM_EPS));
    const float normed = __bfloat162float(__float2bfloat16(y * rn * nw));
    out[((size_t)b * HV + h) * DV + t - OUT0] = __float2bfloat16(zv / (1.0f + __expf(-zv)) * normed);
  }
"""


MAX_SHARED = 227 << 10  # the most shared memory a block of sm_90 takes
STATIC_SHARED = 16 << 10  # room for the kernel's own arrays (q, k, v and the sums: 12.3 KB at value dim 1024)
STAGED_THREADS = 1536  # threads an SM holds of a staged kernel's blocks: 3 blocks of 512 (at most 42 registers)


@cache
def _kernel(threads: int, shared: int = 0):
    # The bounds cap a thread at 64 registers, so that 1024 threads fit an SM: two blocks of 512 at qwen27b's
    # heads (Nsight Compute at 64 rows: 70 registers held it to one block, 25% occupancy, 1.8 TB/s; nvcc
    # gives 64 without spills). With the state staged in `shared` bytes of shared memory a thread holds RB rows'
    # values, not its whole share, and the cap lets STAGED_THREADS fit. Registers change no arithmetic.
    blocks = min(STAGED_THREADS // threads, MAX_SHARED // shared) if shared else 1024 // threads
    return cuda_kernel(
        name=f"engine_gated_delta_step_{threads}" + (f"_ss{shared}" if shared else ""),
        input_names=["qkv", "conv_state", "conv_w", "z", "a", "beta_logits", "A_log", "dt_bias", "norm_w", "state"],
        output_names=["out", "new_conv", "new_state"],
        source=SOURCE,
        header=HEADER + launch_bounds(threads, max(1, blocks)),
        shared_memory=shared,
    )


def refusal(dk: int, dv: int) -> str | None:
    """Why the kernel cannot run heads of key dim `dk` and value dim `dv` (None when it can): q and k are
    normalized by sums over the warps of the first `dv` threads, and lanes split the key dimension."""
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


def staged_rows(dk: int, dv: int) -> int | None:
    """State rows a warp takes at once with the state staged in shared memory (`delta_step`'s `staged`): 2, or 1
    where the value dim's rows do not split into rounds of 2 a warp; None where they split into neither."""
    warps = launch_shape(dk, dv)[0] // 32
    return next((r for r in (2, 1) if dv % (r * warps) == 0), None)


def staged_by_default(state_dtype: mx.Dtype) -> bool:
    """Whether `delta_step` stages the state unless told: a 16-bit state, whose staged kernel took 10.9 / 31.5 /
    49.2 / 88.7 us at 1 / 16 / 32 / 64 rows of qwen27b's heads against 13.8 / 34.5 / 55.8 / 98.2 (H100,
    `tools.gpu.batch_parts`); with a float32 state (twice the shared bytes a head) it was slower from 32 rows."""
    return state_dtype.size == 2


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
    staged: bool | None = None,
):
    """The arguments and results of `gated_delta_decode._core` (qkv [B, 1, C], z [B, 1, Hv * Dv], a and
    beta_logits [B, 1, Hv], conv_state [B, K - 1, C], state [B, Hv, Dv, Dk], conv_w [C, K, 1]):
    (out [B, 1, Hv * Dv] bf16, new conv_state, new state). CUDA only; Dk <= Dv, both multiples of 32
    (`refusal`). The kernel reads its inputs as flat arrays, so none is reshaped (a reshape is a graph node
    the host handles every step). `staged`: each head's state copied into shared memory first and read from
    there in rounds (`staged_rows`), where it fits; the same arithmetic in the same order, so the same bits
    (None: `staged_by_default`)."""
    batch, hv, dv, _ = state.shape
    why = refusal(dk, dv)
    if why:
        raise ValueError(why)
    ks = conv_w.shape[1]
    threads, rows = launch_shape(dk, dv)
    if staged is None:
        staged = staged_by_default(state.dtype)
    in_rounds = staged_rows(dk, dv) if staged else None
    size = dv * dk * state.itemsize
    shared = size if in_rounds and size <= MAX_SHARED - STATIC_SHARED else 0
    rows = in_rounds if shared else rows
    out, new_conv, new_state = _kernel(threads, shared)(
        inputs=[qkv, conv_state, conv_w, z, a, beta_logits, A_log, dt_bias, norm_w, state],
        template=[
            ("HK", heads_k),
            ("HV", hv),
            ("DK", dk),
            ("DV", dv),
            ("KS", ks),
            ("NT", threads),
            ("RB", rows),
            ("SS", int(shared > 0)),
            ("QK_EPS", float_bits(qk_eps)),
            ("NORM_EPS", float_bits(norm_eps)),
        ],  # not inputs: see float_bits
        grid=(batch * hv * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(batch, 1, hv * dv), conv_state.shape, state.shape],
        output_dtypes=[mx.bfloat16, conv_state.dtype, state.dtype],
    )
    return out, new_conv, new_state
