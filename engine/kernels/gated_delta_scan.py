"""A Gated DeltaNet layer's core over a short run of tokens as one CUDA kernel: the decode step's kernel
(gated_delta_step) with a loop over the tokens inside it.

A prompt chunk of a few dozen to a few hundred tokens runs the chunked rule (gated_delta_chunked) as ~100
graph nodes a layer, plus the conv, the q/k norms and the gated norm around it: on an H100 a 96-token
qwen27b forward spent ~1.3 ms a DeltaNet layer in the rule alone, mostly launches of small kernels
(`tools.gpu.prefill_parts`). Here each block keeps its head's whole state in registers across the tokens
and writes it once at the end, so the layer's core is one launch whatever the length; the tokens run one
after another, so its time grows with the length where the chunked rule's matrix products do not, and it
serves short runs: a verify window (the state after each token recorded, `trace`) and prompt chunks up to
`KernelConfig.scan_tokens`.

Each token's arithmetic is the step kernel's, in the same order: the conv over the previous K - 1
positions (from the conv state, then from the run itself), the rounding to bf16 where the compiled core
rounds, the state carried in float32 and rounded to the state's dtype after each token as the step kernel
stores and reloads it. So the outputs, the final state and every traced state are bit for bit those of the
step kernel run token after token (tests/unit/test_kernels.py checks on CUDA). Rows of a right-padded batch
stop at their own length (`ends`): their state and conv tail are taken there, and their padded positions'
outputs are zero.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.kernels import gated_delta_step
from engine.kernels.cuda_source import cuda_kernel
from engine.kernels.quantized_gemv import float_bits, launch_bounds

HEADER = (
    gated_delta_step.HEADER
    + r"""
__device__ __forceinline__ float engine_round(const float*, float v) { return v; }
__device__ __forceinline__ float engine_round(const __nv_bfloat16*, float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ float engine_round(const __half*, float v) { return __half2float(__float2half(v)); }
"""
)

SOURCE = r"""
  // Block (b, h): batch row b, value head h; thread t: value channel t (and key channel t for q and k).
  const int b = blockIdx.x / HV, h = blockIdx.x % HV, batch = gridDim.x / HV;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  constexpr int KD = HK * DK;           // key channels; conv channels are q (KD), k (KD), v (HV * DV)
  constexpr int C = 2 * KD + HV * DV;
  constexpr int GROUP = HV / HK;        // value heads per key head
  constexpr int NW = NT / 32;           // warps: the first DV / 32 hold a value channel a thread
  constexpr int VW = DV / 32;
  static_assert(DV == RB * NW, "the head's whole state in registers: RB rows a warp, one round");
  const int hk = h / GROUP;
  const int len = length[0];            // the run's tokens; this row's real ones are the first n
  const int n = ends[b];
  __shared__ float qs[DK], ks[DK], vs[DV], red[2][NW];

  const auto* s_in = state + ((size_t)b * HV + h) * DV * DK;
  auto* s_out = new_state + ((size_t)b * HV + h) * DV * DK;
  float s[RB][DK / 32];                 // warp w holds rows w + NW * r, lanes across the key dimension
  #pragma unroll
  for (int r = 0; r < RB; ++r)
    #pragma unroll
    for (int j = 0; j < DK / 32; ++j) s[r][j] = (float)s_in[(size_t)(warp + r * NW) * DK + lane + 32 * j];

  auto at = [&](int pos, int c) -> float {  // position pos of [conv state (K - 1); the run (len)], channel c
    return pos < KS - 1 ? (float)conv_state[((size_t)b * (KS - 1) + pos) * C + c]
                        : (float)qkv[((size_t)b * len + pos - (KS - 1)) * C + c];
  };
  auto conv = [&](int p, int c) -> float {  // token p's depthwise conv over its K positions, SiLU
    float acc = 0.0f;
    #pragma unroll
    for (int j = 0; j < KS; ++j) acc += at(p + j, c) * (float)conv_w[(size_t)c * KS + j];
    return __bfloat162float(__float2bfloat16(acc / (1.0f + __expf(-acc))));
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
  const bool bf16_bias = engine_is_bf16(dt_bias);
  auto round_like_bias = [&](float x) { return bf16_bias ? __bfloat162float(__float2bfloat16(x)) : x; };
  const float inv = rsqrtf((float)DK);
  const float eps = __int_as_float(QK_EPS) * inv * inv;

  for (int p = 0; p < n; ++p) {
    if (t < DK) {
      qs[t] = conv(p, hk * DK + t);
      ks[t] = conv(p, KD + hk * DK + t);
    }
    if (t < DV) vs[t] = conv(p, 2 * KD + h * DV + t);
    __syncthreads();
    {  // q, k: RMS-normalized, times Dk^-1 and Dk^-0.5, rounded to bf16 twice (the step kernel's)
      const float qv = t < DK ? qs[t] : 0.0f, kv = t < DK ? ks[t] : 0.0f;
      const float qss = block_sum(qv * qv, 0), kss = block_sum(kv * kv, 1);
      if (t < DK) {
        const float qn = __bfloat162float(__float2bfloat16(qv * rsqrtf(qss / DK + eps)));
        const float kn = __bfloat162float(__float2bfloat16(kv * rsqrtf(kss / DK + eps)));
        qs[t] = __bfloat162float(__float2bfloat16(qn * inv * inv));
        ks[t] = __bfloat162float(__float2bfloat16(kn * inv));
      }
    }
    __syncthreads();
    const size_t gi = ((size_t)b * len + p) * HV + h;
    const float av = round_like_bias((float)a[gi] + (float)dt_bias[h]);
    const float sp = round_like_bias(av > 20.0f ? av : log1pf(__expf(av)));
    const float g = __expf(-__expf((float)A_log[h]) * sp);
    const float beta = __bfloat162float(__float2bfloat16(1.0f / (1.0f + __expf(-(float)beta_logits[gi]))));

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
      const int i = warp + r * NW;
      const float delta = (vs[i] - kv_mem[r]) * beta;
      y[r] = 0.0f;
      #pragma unroll
      for (int j = 0; j < DK / 32; ++j) {
        s[r][j] += ks[lane + 32 * j] * delta;
        if (TRACE) engine_store(&states[(((size_t)p * batch + b) * HV + h) * DV * DK + (size_t)i * DK + lane + 32 * j], s[r][j]);
        y[r] += s[r][j] * qs[lane + 32 * j];
        s[r][j] = engine_round(s_in, s[r][j]);  // as the step kernel stores it and the next step reads it
      }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      #pragma unroll
      for (int r = 0; r < RB; ++r) y[r] += __shfl_xor_sync(0xffffffffu, y[r], o);
    }
    if (lane == 0) {  // a warp reads and writes only its own rows of vs
      #pragma unroll
      for (int r = 0; r < RB; ++r) vs[warp + r * NW] = __bfloat162float(__float2bfloat16(y[r]));
    }
    __syncthreads();
    {  // gated RMS norm: bf16(y * rsqrt(mean(y^2) + eps) * w), then silu(z) times it, in float32
      const float yv = t < DV ? vs[t] : 0.0f;
      const float yss = block_sum(yv * yv, 0);
      if (t < DV) {
        const size_t oi = ((size_t)b * len + p) * HV * DV + (size_t)h * DV + t;
        const float rn = rsqrtf(yss / DV + __int_as_float(NORM_EPS));
        const float normed = __bfloat162float(__float2bfloat16(yv * rn * (float)norm_w[t]));
        const float zv = (float)z[oi];
        out[oi] = __float2bfloat16(zv / (1.0f + __expf(-zv)) * normed);
      }
    }
    __syncthreads();  // the next token's q, k, v and sums overwrite the shared arrays
  }

  if (t < DV)
    for (int p = n; p < len; ++p) out[((size_t)b * len + p) * HV * DV + (size_t)h * DV + t] = __float2bfloat16(0.0f);
  #pragma unroll
  for (int r = 0; r < RB; ++r)
    #pragma unroll
    for (int j = 0; j < DK / 32; ++j) engine_store(&s_out[(size_t)(warp + r * NW) * DK + lane + 32 * j], s[r][j]);
  auto tail = [&](int c) {              // the conv state after the row's last real token: positions n .. n + K - 2
    #pragma unroll
    for (int j = 0; j < KS - 1; ++j) engine_store(&new_conv[((size_t)b * (KS - 1) + j) * C + c], at(n + j, c));
  };
  if (t < DK && h % GROUP == 0) {
    tail(hk * DK + t);
    tail(KD + hk * DK + t);
  }
  if (t < DV) tail(2 * KD + h * DV + t);
"""


@cache
def _kernel(threads: int):
    # the step kernel's bounds (64 registers a thread, two blocks of 512 an SM)
    return cuda_kernel(
        name=f"engine_gated_delta_scan_{threads}",
        input_names=[
            "qkv",
            "conv_state",
            "conv_w",
            "z",
            "a",
            "beta_logits",
            "A_log",
            "dt_bias",
            "norm_w",
            "state",
            "ends",
            "length",
        ],
        output_names=["out", "new_conv", "new_state", "states"],
        source=SOURCE,
        header=HEADER + launch_bounds(threads, max(1, 1024 // threads)),
    )


def refusal(dk: int, dv: int) -> str | None:
    """Why the kernel cannot run heads of key dim `dk` and value dim `dv` (None when it can): the step
    kernel's conditions, and a head's whole state in one round of a block's registers."""
    why = gated_delta_step.refusal(dk, dv)
    if why:
        return why
    threads, rows = gated_delta_step.launch_shape(dk, dv)
    if rows * (threads // 32) != dv:
        return f"key dim {dk} and value dim {dv}: the state takes more than one round of the block's rows"
    return None


def delta_scan(
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
    ends: mx.array | None = None,
    trace: bool = False,
    qk_eps: float = 1e-6,
):
    """`gated_delta_step.delta_step` over a run of T tokens (qkv [B, T, C], z [B, T, Hv * Dv], a and
    beta_logits [B, T, Hv]; conv_state [B, K - 1, C], state [B, Hv, Dv, Dk]): (out [B, T, Hv * Dv] bf16,
    the conv state and the state after each row's last real token, and with `trace` the state after every
    token [T, B, Hv, Dv, Dk], else None). `ends` [B] int32: each row's real tokens (None: all T). CUDA only."""
    batch, hv, dv, _ = state.shape
    length = qkv.shape[1]
    why = refusal(dk, dv)
    if why:
        raise ValueError(why)
    if ends is None:
        ends = mx.full((batch,), length, dtype=mx.int32)
    threads, rows = gated_delta_step.launch_shape(dk, dv)
    out, new_conv, new_state, states = _kernel(threads)(
        inputs=[
            qkv,
            conv_state,
            conv_w,
            z,
            a,
            beta_logits,
            A_log,
            dt_bias,
            norm_w,
            state,
            ends.astype(mx.int32),
            mx.array([length], dtype=mx.int32),
        ],
        template=[
            ("HK", heads_k),
            ("HV", hv),
            ("DK", dk),
            ("DV", dv),
            ("KS", conv_w.shape[1]),
            ("NT", threads),
            ("RB", rows),
            ("TRACE", int(trace)),
            ("QK_EPS", float_bits(qk_eps)),
            ("NORM_EPS", float_bits(norm_eps)),
        ],
        grid=(batch * hv * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[
            (batch, length, hv * dv),
            conv_state.shape,
            state.shape,
            (length, *state.shape) if trace else (1,),
        ],
        output_dtypes=[mx.bfloat16, conv_state.dtype, state.dtype, state.dtype],
    )
    return out, new_conv, new_state, states if trace else None
