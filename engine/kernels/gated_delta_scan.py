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
  const bool has_qk = t < DK, has_v = t < DV;
  const int cq = hk * DK + t, ck = KD + hk * DK + t, cv = 2 * KD + h * DV + t;  // this thread's conv channels
  __shared__ float qs[DK], ks[DK], vs[DV], red[2][NW];

  const auto* s_in = state + ((size_t)b * HV + h) * DV * DK;
  auto* s_out = new_state + ((size_t)b * HV + h) * DV * DK;
  float s[RB][DK / 32];                 // warp w holds rows w + NW * r, lanes across the key dimension
  #pragma unroll
  for (int r = 0; r < RB; ++r)
    #pragma unroll
    for (int j = 0; j < DK / 32; ++j) s[r][j] = (float)s_in[(size_t)(warp + r * NW) * DK + lane + 32 * j];

  // Each channel's conv weights and its last K - 1 inputs stay in registers (the window slides a token a time);
  // the next token's inputs are loaded while the current one computes.
  float wq[KS], wk[KS], wv[KS], xq[KS - 1], xk[KS - 1], xv[KS - 1];
  #pragma unroll
  for (int j = 0; j < KS; ++j) {
    wq[j] = has_qk ? (float)conv_w[(size_t)cq * KS + j] : 0.0f;
    wk[j] = has_qk ? (float)conv_w[(size_t)ck * KS + j] : 0.0f;
    wv[j] = has_v ? (float)conv_w[(size_t)cv * KS + j] : 0.0f;
  }
  #pragma unroll
  for (int j = 0; j < KS - 1; ++j) {
    const size_t row = ((size_t)b * (KS - 1) + j) * C;
    xq[j] = has_qk ? (float)conv_state[row + cq] : 0.0f;
    xk[j] = has_qk ? (float)conv_state[row + ck] : 0.0f;
    xv[j] = has_v ? (float)conv_state[row + cv] : 0.0f;
  }
  float nq = 0.0f, nk = 0.0f, nv = 0.0f, nz = 0.0f, na = 0.0f, nbl = 0.0f;
  auto fetch = [&](const int p) {       // token p's inputs (none past the row's end)
    if (p >= n) return;
    const size_t row = ((size_t)b * len + p) * C;
    if (has_qk) {
      nq = (float)qkv[row + cq];
      nk = (float)qkv[row + ck];
    }
    if (has_v) {
      nv = (float)qkv[row + cv];
      nz = (float)z[((size_t)b * len + p) * HV * DV + (size_t)h * DV + t];
    }
    na = (float)a[((size_t)b * len + p) * HV + h];
    nbl = (float)beta_logits[((size_t)b * len + p) * HV + h];
  };
  auto conv = [&](float (&x)[KS - 1], const float (&w)[KS], const float cur) -> float {
    float acc = 0.0f;                   // over the K positions in order, as the step kernel sums them
    #pragma unroll
    for (int j = 0; j < KS - 1; ++j) acc += x[j] * w[j];
    acc += cur * w[KS - 1];
    #pragma unroll
    for (int j = 0; j < KS - 2; ++j) x[j] = x[j + 1];
    x[KS - 2] = cur;
    return __bfloat162float(__float2bfloat16(acc / (1.0f + __expf(-acc))));
  };
  auto warp_sum = [&](float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  };
  const bool bf16_bias = engine_is_bf16(dt_bias);
  auto round_like_bias = [&](float x) { return bf16_bias ? __bfloat162float(__float2bfloat16(x)) : x; };
  const float inv = rsqrtf((float)DK);
  const float eps = __int_as_float(QK_EPS) * inv * inv;
  const float decay_rate = __expf((float)A_log[h]);

  fetch(0);
  for (int p = 0; p < n; ++p) {
    const float q_in = nq, k_in = nk, v_in = nv, zv = nz, a_in = na, b_in = nbl;
    fetch(p + 1);
    if (has_qk) {
      qs[t] = conv(xq, wq, q_in);
      ks[t] = conv(xk, wk, k_in);
    }
    if (has_v) vs[t] = conv(xv, wv, v_in);
    __syncthreads();
    {  // q, k: RMS-normalized, times Dk^-1 and Dk^-0.5, rounded to bf16 twice (the step kernel's); both sums
       // of squares over the block behind one barrier
      const float qv = has_qk ? qs[t] : 0.0f, kv = has_qk ? ks[t] : 0.0f;
      const float qw = warp_sum(qv * qv), kw = warp_sum(kv * kv);
      if (lane == 0) {
        red[0][warp] = qw;
        red[1][warp] = kw;
      }
      __syncthreads();
      float qss = 0.0f, kss = 0.0f;
      #pragma unroll
      for (int w = 0; w < VW; ++w) {
        qss += red[0][w];
        kss += red[1][w];
      }
      if (has_qk) {
        const float qn = __bfloat162float(__float2bfloat16(qv * rsqrtf(qss / DK + eps)));
        const float kn = __bfloat162float(__float2bfloat16(kv * rsqrtf(kss / DK + eps)));
        qs[t] = __bfloat162float(__float2bfloat16(qn * inv * inv));
        ks[t] = __bfloat162float(__float2bfloat16(kn * inv));
      }
    }
    __syncthreads();
    const float av = round_like_bias(a_in + (float)dt_bias[h]);
    const float sp = round_like_bias(av > 20.0f ? av : log1pf(__expf(av)));
    const float g = __expf(-decay_rate * sp);
    const float beta = __bfloat162float(__float2bfloat16(1.0f / (1.0f + __expf(-b_in))));

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
      const float yv = has_v ? vs[t] : 0.0f;
      const float yw = warp_sum(yv * yv);
      if (lane == 0) red[0][warp] = yw;
      __syncthreads();
      float yss = 0.0f;
      #pragma unroll
      for (int w = 0; w < VW; ++w) yss += red[0][w];
      if (has_v) {
        const float rn = rsqrtf(yss / DV + __int_as_float(NORM_EPS));
        const float normed = __bfloat162float(__float2bfloat16(yv * rn * (float)norm_w[t]));
        out[((size_t)b * len + p) * HV * DV + (size_t)h * DV + t] = __float2bfloat16(zv / (1.0f + __expf(-zv)) * normed);
      }
    }
    // no barrier here: the next token's first writes (its own q, k, v channels) come before a barrier that
    // every thread reaches only after this token's last reads of the shared arrays
  }

  if (has_v)
    for (int p = n; p < len; ++p) out[((size_t)b * len + p) * HV * DV + (size_t)h * DV + t] = __float2bfloat16(0.0f);
  #pragma unroll
  for (int r = 0; r < RB; ++r)
    #pragma unroll
    for (int j = 0; j < DK / 32; ++j) engine_store(&s_out[(size_t)(warp + r * NW) * DK + lane + 32 * j], s[r][j]);
  // the conv state after the row's last real token: the window's K - 1 positions
  #pragma unroll
  for (int j = 0; j < KS - 1; ++j) {
    const size_t row = ((size_t)b * (KS - 1) + j) * C;
    if (has_qk && h % GROUP == 0) {
      engine_store(&new_conv[row + cq], xq[j]);
      engine_store(&new_conv[row + ck], xk[j]);
    }
    if (has_v) engine_store(&new_conv[row + cv], xv[j]);
  }
"""


@cache
def _kernel(threads: int):
    # one block of 512 an SM may hold (the step kernel asks two, capping a thread at 64 registers): a run keeps
    # each channel's conv weights and window and the next token's inputs beside the state, which at 64 spilled
    # ~100 bytes a thread (nvcc, qwen27b's heads); one row's 48 blocks take one an SM anyway
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
        header=HEADER + launch_bounds(threads, 1),
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
