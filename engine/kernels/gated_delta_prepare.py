"""The chunked Gated DeltaNet prefill's chunk-local part as one CUDA launch a layer.

`gated_delta_chunked._prepare` computes, for every 64-token chunk of every head at once, the quantities that do
not depend on the state: the decays, A = strictly-lower(beta_i (G_i / G_j) k_i.k_j), W and U~ through
(I + A)^-1 (ten doubling products), Q K^T with its decays, and the decayed q and k. As MLX operations that is
~35 launches a layer (products of [.., 64, 64] tiles in TF32, elementwise stages, the copies that lay the
inputs out by chunk): on an H100 ~0.8 ms of a 1,024-token qwen27b layer's 1.0 ms rule once the states run as
one launch (`reports/gpu/qwen27b-chunk-states-h100.txt`). Here a block takes one head's chunk: it reads its q
and k rows (key head h // (Hv / Hk), no repeated copy) into shared memory as float32, forms K K^T and Q K^T in
4 x 4 tiles, then solves (I + A) [W | U~] = [diag(beta G) K | diag(beta) V] by forward substitution, a
thread a column with the column's rows in registers (exact arithmetic for a unit lower-triangular system:
no inverse is formed). Rows past the prompt's end are zeros with log g = 0 and beta = 0, as the MLX path pads.
Float32 fused multiply-adds in a fixed order: the MLX path's values to its rounding (its products run as TF32
on CUDA), not bit for bit: the fast tier.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.kernels.cuda_source import cuda_kernel
from engine.kernels.gated_delta_chunked import LOG_FLOOR
from engine.kernels.quantized_gemv import launch_bounds

THREADS = 256

SOURCE = r"""
  // Block (b * H + h) * N + i: value head h's chunk i of C tokens (rows past the prompt's T are zeros).
  constexpr int DKP = DK + 4, CP = C + 4;           // rows padded: neighbouring rows in other banks
  static_assert(NT >= C && C % 4 == 0 && DK % 4 == 0, "a thread a row's decay and beta; rows read 4 at a time");
  const int T = length[0], N = (T + C - 1) / C;
  const int i = blockIdx.x % N, bh = blockIdx.x / N, h = bh % H, b = bh / H;
  const int hk = h / (H / HK), t0 = i * C, t = threadIdx.x;
  extern __shared__ __align__(16) float engine_smem[];
  float* sk = engine_smem;                          // [C][DKP] k, float32
  float* sq = sk + C * DKP;                         // [C][DKP] q
  float* sa = sq + C * DKP;                         // [C][CP]  A, strictly lower
  float* scum = sa + C * CP;                        // [C]      cumulative log decay (floored)
  float* sbeta = scum + C;                          // [C]

  for (int e = t; e < C * DK; e += NT) {
    const int r = e / DK, d = e % DK, tok = t0 + r;
    float kv = 0.0f, qv = 0.0f;
    if (tok < T) {
      const size_t off = (((size_t)b * T + tok) * HK + hk) * DK + d;
      kv = (float)k[off];
      qv = (float)q[off];
    }
    sk[r * DKP + d] = kv;
    sq[r * DKP + d] = qv;
  }
  if (t < C) {
    const int tok = t0 + t;
    const size_t off = ((size_t)b * T + tok) * H + h;
    sbeta[t] = tok < T ? (float)beta[off] : 0.0f;
    scum[t] = tok < T ? fmaxf((float)log_g[off], LOG_FLOOR) : 0.0f;
  }
  __syncthreads();
  if (t == 0) {
    float c = 0.0f;
    for (int r = 0; r < C; ++r) {
      c += scum[r];
      scum[r] = c;
    }
  }
  __syncthreads();

  const size_t chunk = (size_t)bh * N + i;
  // A = beta_i (G_i / G_j) k_i.k_j below the diagonal; QK = (G_i / G_j) q_i.k_j on and below it: 4 x 4 tiles.
  for (int e = t; e < (C / 4) * (C / 4); e += NT) {
    const int r0 = (e / (C / 4)) * 4, c0 = (e % (C / 4)) * 4;
    float kk[4][4] = {}, qk[4][4] = {};
    if (c0 <= r0) {
      for (int d = 0; d < DK; d += 4) {
        float4 ki[4], qi[4], kj[4];
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
          ki[r] = *reinterpret_cast<const float4*>(sk + (r0 + r) * DKP + d);
          qi[r] = *reinterpret_cast<const float4*>(sq + (r0 + r) * DKP + d);
          kj[r] = *reinterpret_cast<const float4*>(sk + (c0 + r) * DKP + d);
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r)
          #pragma unroll
          for (int s = 0; s < 4; ++s) {
            kk[r][s] = fmaf(ki[r].x, kj[s].x, kk[r][s]);
            kk[r][s] = fmaf(ki[r].y, kj[s].y, kk[r][s]);
            kk[r][s] = fmaf(ki[r].z, kj[s].z, kk[r][s]);
            kk[r][s] = fmaf(ki[r].w, kj[s].w, kk[r][s]);
            qk[r][s] = fmaf(qi[r].x, kj[s].x, qk[r][s]);
            qk[r][s] = fmaf(qi[r].y, kj[s].y, qk[r][s]);
            qk[r][s] = fmaf(qi[r].z, kj[s].z, qk[r][s]);
            qk[r][s] = fmaf(qi[r].w, kj[s].w, qk[r][s]);
          }
      }
    }
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int ri = r0 + r;
      float4 out;
      float* o = &out.x;
      #pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int cj = c0 + s;
        const float decay = cj <= ri ? expf(scum[ri] - scum[cj]) : 0.0f;
        sa[ri * CP + cj] = cj < ri ? sbeta[ri] * decay * kk[r][s] : 0.0f;
        o[s] = cj <= ri ? qk[r][s] * decay : 0.0f;
      }
      *reinterpret_cast<float4*>(qk_out + (chunk * C + ri) * C + c0) = out;
    }
  }

  // The decayed q and k, the chunk's decay.
  const float last = scum[C - 1];
  for (int e = t; e < C * DK / 4; e += NT) {
    const int r = e / (DK / 4), d = (e % (DK / 4)) * 4;
    const float gq = expf(scum[r]), gk = expf(last - scum[r]);
    const float4 qv = *reinterpret_cast<const float4*>(sq + r * DKP + d);
    const float4 kv = *reinterpret_cast<const float4*>(sk + r * DKP + d);
    const size_t o = (chunk * C + r) * DK + d;
    *reinterpret_cast<float4*>(q_decayed + o) = make_float4(gq * qv.x, gq * qv.y, gq * qv.z, gq * qv.w);
    *reinterpret_cast<float4*>(k_decayed + o) = make_float4(gk * kv.x, gk * kv.y, gk * kv.z, gk * kv.w);
  }
  if (t == 0) chunk_decay[chunk] = expf(last);
  __syncthreads();                                  // A whole

  // (I + A) X = [diag(beta G) K | diag(beta) V], column by column: the column's right-hand side loaded into
  // registers first (its loads all in flight at once), then X's rows in place, A's read 4 at a time.
  for (int col = t; col < DK + DV; col += NT) {
    const bool is_k = col < DK;
    float x[C];
    #pragma unroll
    for (int r = 0; r < C; ++r) {
      if (is_k) {
        x[r] = sbeta[r] * expf(scum[r]) * sk[r * DKP + col];
      } else {
        const int tok = t0 + r;
        x[r] = tok < T ? sbeta[r] * (float)v[(((size_t)b * T + tok) * H + h) * DV + col - DK] : 0.0f;
      }
    }
    #pragma unroll
    for (int r = 1; r < C; ++r) {
      float acc = x[r];
      #pragma unroll
      for (int j = 0; j + 4 <= r; j += 4) {
        const float4 a = *reinterpret_cast<const float4*>(sa + r * CP + j);
        acc = fmaf(-a.x, x[j], acc);
        acc = fmaf(-a.y, x[j + 1], acc);
        acc = fmaf(-a.z, x[j + 2], acc);
        acc = fmaf(-a.w, x[j + 3], acc);
      }
      #pragma unroll
      for (int j = r & ~3; j < r; ++j) acc = fmaf(-sa[r * CP + j], x[j], acc);
      x[r] = acc;
    }
    #pragma unroll
    for (int r = 0; r < C; ++r) {
      if (is_k) w_out[(chunk * C + r) * DK + col] = x[r];
      else u_tilde[(chunk * C + r) * DV + col - DK] = x[r];
    }
  }
"""


def fits(dk: int, dv: int, chunk: int = 64) -> bool:
    """Whether the kernel runs heads of key dim `dk` and value dim `dv` in chunks of `chunk` tokens: rows copied
    4 values at a time, a column's `chunk` rows in registers."""
    return dk % 4 == 0 and chunk % 4 == 0 and chunk <= 64 and shared_bytes(dk, chunk) <= 100 << 10


def shared_bytes(dk: int, chunk: int = 64) -> int:
    """A block's dynamic shared memory: q and k rows, A, the decays and betas (two blocks an SM at qwen27b's)."""
    return 4 * (2 * chunk * (dk + 4) + chunk * (chunk + 4) + 2 * chunk)


@cache
def _kernel(shared: int, log_floor: float):
    header = launch_bounds(THREADS, 2) + f"#define LOG_FLOOR ({log_floor!r}f)\n"
    return cuda_kernel(
        name="engine_gated_delta_prepare",
        input_names=["q", "k", "v", "log_g", "beta", "length"],
        output_names=["u_tilde", "w_out", "q_decayed", "qk_out", "k_decayed", "chunk_decay"],
        source=SOURCE,
        header=header,
        shared_memory=shared,
    )


def chunk_prepare(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, chunk: int
) -> tuple[mx.array, ...]:
    """`gated_delta_chunked.prepare_chunks` as one launch: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; log_g and beta
    [B, T, Hv] (a batch mask already applied) -> (U~, W, diag(G) Q, (Q K^T) * decays, decayed K [B, Hv, N, C,
    ...], the chunks' decays [B, Hv, N]), float32. CUDA only; ValueError for heads it cannot take."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if not fits(dk, dv, chunk) or hv % hk:
        raise ValueError(f"no chunk-prepare kernel for key dim {dk}, value dim {dv}, chunks of {chunk}")
    n = -(-t // chunk)
    f32 = mx.float32
    return tuple(
        _kernel(shared_bytes(dk, chunk), LOG_FLOOR)(
            inputs=[q, k, v, log_g.astype(f32), beta.astype(f32), mx.array([t], dtype=mx.int32)],
            template=[("H", hv), ("HK", hk), ("DK", dk), ("DV", dv), ("C", chunk), ("NT", THREADS)],
            grid=(b * hv * n * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[
                (b, hv, n, chunk, dv),
                (b, hv, n, chunk, dk),
                (b, hv, n, chunk, dk),
                (b, hv, n, chunk, chunk),
                (b, hv, n, chunk, dk),
                (b, hv, n),
            ],
            output_dtypes=[f32] * 6,
        )
    )
