"""Prompt attention as one CUDA launch: causal softmax attention over a chunk's queries, tile by tile.

MLX 0.32.4's CUDA backend runs `mx.fast.scaled_dot_product_attention` for more than one query as separate
operations (the scores as a product, the causal mask as a select over them, a softmax, the product with V),
so a chunk of L queries against S keys writes and reads its [heads, L, S] scores several times: on an H100 a
4,096-token qwen27b forward (head dim 256) spent ~36 of its ~500 ms of device time there, and the cost grows
with the square of the context. Here a block takes 64 queries of one head and walks the keys 64 at a time
(FlashAttention's order): the scores of a tile on the tensor cores (`mma.sync` m16n8k16, bf16 in, float32
out), the running row maximum and sum in float32 (exp2 of scaled scores), the probabilities rounded to bf16
for their product with V, the output divided by the sum at the end. Nothing the size of the scores is ever
written. Keys past a query's position (causal: query i of the chunk sits at S - L + i) and past S count
zero, as do a batch row's keys before its left padding ends (`BatchKVCache`'s mask); the next tile's K and V
are copied (`cp.async`) while the current one computes.

The sums differ from MLX's path by rounding (its scores are rounded to bf16 before the softmax, here they stay
float32): the fast tier, judged by the gate.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.cache.batch_kv import BatchKVCache
from engine.kernels.cuda_source import CP_ASYNC16, MMA_BF16, TO_BF16X2, cuda_kernel
from engine.kernels.quantized_gemv import launch_bounds
from engine.models.base import scaled_dot_product_attention

BM = 64  # queries a block (four warps of 16)
BN = 64  # keys a tile
THREADS = 128
HEAD_DIMS = (64, 128, 256)
MIN_QUERIES = BM  # fewer: most of a block's rows empty and a block a head (a verify window): MLX's products win

SOURCE = r"""
  // Block: (query block from the last, then batch x head); warp w takes queries q0 + 16 w ... + 15.
  constexpr int DP = D + 8;                         // shared rows padded: 8 rows of a fragment read 32 banks
  const int L = dims[0], S = dims[1], offset = CAUSAL ? S - L : 0;
  const int nqb = (L + BM - 1) / BM, bhs = gridDim.x / nqb;
  const int qb = nqb - 1 - (int)blockIdx.x / bhs, bh = (int)blockIdx.x % bhs;  // the longest key ranges first
  const int b = bh / HQ, h = bh % HQ, kvh = h / (HQ / HKV), q0 = qb * BM;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32, lg = lane / 4, lt = lane % 4;
  const int pad = pads[b];                          // this row's keys below pad (left padding) count zero
  const int kend = CAUSAL ? min(S, offset + q0 + BM) : S, kstart = min(pad, kend) / BN * BN;
  const __nv_bfloat16* qp = q + ((size_t)(b * HQ + h) * L + q0) * D;
  const __nv_bfloat16* kp = k + (size_t)(b * HKV + kvh) * S * D;
  const __nv_bfloat16* vp = v + (size_t)(b * HKV + kvh) * S * D;
  extern __shared__ __align__(16) __nv_bfloat16 engine_smem_bf[];
  __nv_bfloat16* sq = engine_smem_bf;               // [BM][DP]
  __nv_bfloat16* sk = sq + BM * DP;                 // [BN][DP]
  __nv_bfloat16* sv = sk + BN * DP;                 // [BN][DP]

  static_assert(BM == BN && BM == 16 * (THREADS / 32), "a warp's 16 queries; K and V tiles as many rows as Q's");
  auto copy_rows = [&](__nv_bfloat16* dst, const __nv_bfloat16* src, const int rows) {  // BM rows, past `rows` 0
    for (int e = t; e < BM * (D / 8); e += THREADS) {
      const int r = e / (D / 8), c = (e % (D / 8)) * 8;
      if (r < rows) engine_cp16(dst + r * DP + c, src + (size_t)r * D + c);
      else *reinterpret_cast<uint4*>(dst + r * DP + c) = make_uint4(0, 0, 0, 0);
    }
  };
  auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };
  auto wait_one = [] { asm volatile("cp.async.wait_group 1;" ::: "memory"); };

  copy_rows(sq, qp, min(BM, L - q0));
  copy_rows(sk, kp + (size_t)kstart * D, min(BN, S - kstart));
  commit();
  copy_rows(sv, vp + (size_t)kstart * D, min(BN, S - kstart));
  commit();

  const float scale_log2 = scale[0] * 1.4426950408889634f;
  float o[D / 8][4];
  #pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // rows lg and lg + 8: running, this
                                                    // thread's share of the sum (its quad's four add up at the end)
  const int m0 = warp * 16;
  const int qpos0 = offset + q0 + m0 + lg;          // the position of this thread's first row

  for (int k0 = kstart; k0 < kend; k0 += BN) {
    wait_one();
    __syncthreads();                                // Q and K_j landed (V_j may still come)
    float s[BN / 8][4];
    #pragma unroll
    for (int n = 0; n < BN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    #pragma unroll 4
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      engine_ldsm4(a, sq + (m0 + (lane % 8) + ((lane / 8) & 1) * 8) * DP + kk * 16 + (lane / 16) * 8);
      #pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bk[4];
        engine_ldsm4(bk, sk + (np * 16 + (lane % 8) + (lane / 16) * 8) * DP + kk * 16 + ((lane / 8) & 1) * 8);
        engine_mma(s[2 * np], a[0], a[1], a[2], a[3], bk[0], bk[1]);
        engine_mma(s[2 * np + 1], a[0], a[1], a[2], a[3], bk[2], bk[3]);
      }
    }
    __syncthreads();                                // every warp's reads of K_j done
    if (k0 + BN < kend) copy_rows(sk, kp + (size_t)(k0 + BN) * D, min(BN, S - k0 - BN));
    commit();

    // Scaled scores (log2 units), keys past the row's position, past S or below pad at -inf; the running max
    // and sum.
    const bool edge = k0 + BN > S || (CAUSAL && k0 + BN - 1 > offset + q0) || k0 < pad;
    float tile_max[2] = {-INFINITY, -INFINITY};
    #pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + n * 8 + 2 * lt + (e & 1), pos = qpos0 + (e >> 1) * 8;
        float x = s[n][e] * scale_log2;
        if (edge && (key >= S || key < pad || (CAUSAL && key > pos))) x = -INFINITY;
        s[n][e] = x;
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
      }
    }
    float alpha[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float m_new = fmaxf(row_max[r], tile_max[r]);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: nothing to rescale
      alpha[r] = exp2f(row_max[r] - m_use);
      row_sum[r] *= alpha[r];
      row_max[r] = m_new;
      tile_max[r] = m_use;
    }
    uint32_t p[BN / 16][4];                         // the probabilities as the A fragments of P V
    #pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      const float p0 = exp2f(s[n][0] - tile_max[0]), p1 = exp2f(s[n][1] - tile_max[0]);
      const float p2 = exp2f(s[n][2] - tile_max[1]), p3 = exp2f(s[n][3] - tile_max[1]);
      row_sum[0] += p0 + p1;
      row_sum[1] += p2 + p3;
      p[n / 2][(n % 2) * 2] = engine_to_bf16x2(p0, p1);
      p[n / 2][(n % 2) * 2 + 1] = engine_to_bf16x2(p2, p3);
    }
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
      o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }

    wait_one();
    __syncthreads();                                // V_j landed
    #pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      #pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bv[4];
        engine_ldsm4_t(bv, sv + (kk * 16 + (lane % 8) + ((lane / 8) & 1) * 8) * DP + dp * 16 + (lane / 16) * 8);
        engine_mma(o[2 * dp], p[kk][0], p[kk][1], p[kk][2], p[kk][3], bv[0], bv[1]);
        engine_mma(o[2 * dp + 1], p[kk][0], p[kk][1], p[kk][2], p[kk][3], bv[2], bv[3]);
      }
    }
    __syncthreads();                                // every warp's reads of V_j done
    if (k0 + BN < kend) copy_rows(sv, vp + (size_t)(k0 + BN) * D, min(BN, S - k0 - BN));
    commit();
  }

  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    row_sum[r] = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;  // a row with no key at all: zeros
  }
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + m0 + lg + 8 * r;
    if (row >= L) continue;
    __nv_bfloat16* dst = out + ((size_t)(b * HQ + h) * L + row) * D + 2 * lt;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(dst + n * 8) = engine_to_bf16x2(o[n][2 * r] * row_sum[r],
                                                                   o[n][2 * r + 1] * row_sum[r]);
  }
"""

HEADER = (
    "#include <cuda_bf16.h>\n"
    + CP_ASYNC16
    + MMA_BF16
    + TO_BF16X2
    + r"""
// four 8 x 8 bf16 matrices from shared memory, lanes 8i ... 8i + 7 giving matrix i's row addresses; lane l gets
// row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each (trans: row and column swapped)
__device__ __forceinline__ void engine_ldsm4(uint32_t* r, const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void engine_ldsm4_t(uint32_t* r, const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
"""
)


def shared_bytes(head_dim: int) -> int:
    """A block's dynamic shared memory: Q, K and V tiles of 64 rows, each row padded by 8 values."""
    return 2 * (BM + 2 * BN) * (head_dim + 8)


def runs(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the kernel runs these: bfloat16 heads [B, H, L, D] of a dimension in HEAD_DIMS, at least as many
    keys as queries, query heads a multiple of key heads, values of the keys' shape."""
    if queries.dtype != mx.bfloat16 or keys.dtype != mx.bfloat16 or queries.shape[-1] not in HEAD_DIMS:
        return False
    if queries.ndim != 4 or keys.shape[-2] < queries.shape[-2] or queries.shape[-1] != keys.shape[-1]:
        return False
    return queries.shape[1] % keys.shape[1] == 0 and values.shape == keys.shape and values.dtype == keys.dtype


def kernel_mask(mask, cache) -> tuple[bool, list[int] | None] | None:
    """(causal, each row's left padding or None) where the kernel computes `mask`: none, "causal", or a batch
    cache's own mask (`BatchKVCache.make_mask`: causal, each row's keys from its left padding on); None for
    any other mask."""
    if mask is None:
        return False, None
    if isinstance(mask, str):
        return (True, None) if mask == "causal" else None
    if type(cache) is BatchKVCache:
        return True, list(cache.left_padding)
    return None


@cache
def _kernel(head_dim: int):
    return cuda_kernel(
        name="engine_attention_prefill",
        input_names=["q", "k", "v", "scale", "dims", "pads"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER + launch_bounds(THREADS, 2),
        shared_memory=shared_bytes(head_dim),
    )


def prefill_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    causal: bool = True,
    pads: list[int] | None = None,
) -> mx.array:
    """softmax(scale Q K^T) V for queries [B, Hq, L, D] and keys, values [B, Hkv, S, D], all bfloat16: [B, Hq, L,
    D]. `causal`: query i sits at position S - L + i and sees keys up to it; `pads`: row b sees no key below
    pads[b]. CUDA only; ValueError where it does not `run` them."""
    if not runs(queries, keys, values):
        raise ValueError(f"no prefill attention kernel for {queries.shape} {queries.dtype} against {keys.shape}")
    b, hq, length, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    blocks = b * hq * ((length + BM - 1) // BM)
    inputs = [
        queries,
        keys,
        values,
        mx.array([scale], dtype=mx.float32),
        mx.array([length, s], dtype=mx.int32),
        mx.array(pads if pads is not None else [0] * b, dtype=mx.int32),
    ]
    (out,) = _kernel(d)(
        inputs=inputs,
        template=[
            ("D", d),
            ("HQ", hq),
            ("HKV", hkv),
            ("CAUSAL", int(causal)),
            ("BM", BM),
            ("BN", BN),
            ("THREADS", THREADS),
        ],
        grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[mx.bfloat16],
    )
    return out


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float, mask) -> mx.array:
    """`engine.models.base.scaled_dot_product_attention`'s contract: the kernel for MIN_QUERIES queries or more
    where it `runs` them, computes the mask (`kernel_mask`) and the cache keeps keys unquantized, else that
    function."""
    rule = kernel_mask(mask, cache) if queries.shape[-2] >= MIN_QUERIES and not hasattr(cache, "bits") else None
    if rule is not None and runs(queries, keys, values):
        return prefill_attention(queries, keys, values, scale, *rule)
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask)
