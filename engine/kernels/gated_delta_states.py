"""The chunked Gated DeltaNet prefill's chunk-after-chunk part as one CUDA launch a layer.

In `gated_delta_chunked` everything but the states at the chunks' starts is computed for all chunks at once;
those states run chunk after chunk, per head with S^T [Dk, Dv]:

    U_i = U~_i - W_i S_i^T,    S_{i+1}^T = c_i S_i^T + KD_i^T U_i

(W_i, KD_i [C, Dk]; U~_i, U_i [C, Dv]; c_i the chunk's whole decay). As MLX operations that is two products,
a subtraction, a fused update and the copies of the split views a chunk, each a launch of a few microseconds
that the next one waits for: on an H100 a 1,024-token qwen27b forward spent ~23 of its 144 ms of device time
there and a 4,096-token one ~94 of 556 (`tools.gpu.prefill_kernels --ncu`). Here a block takes one head's JB
value columns (the columns of S^T do not meet: every product above keeps them apart) through all chunks, its
slice of the state in shared memory, each chunk's W, KD and U~ copied in with `cp.async` while the chunk
before it computes. The sums are float32 fused multiply-adds in a fixed order (MLX's float32 products run
as TF32 on CUDA), so the kernel agrees with the MLX path to that path's rounding, not bit for bit: the fast
tier. The outputs are the MLX path's: the state at each chunk's start, each chunk's U and the final state.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from engine.kernels.cuda_source import CP_ASYNC16, cuda_kernel
from engine.kernels.quantized_gemv import launch_bounds

THREADS = 256
MAX_SHARED = 227 << 10  # a Hopper block's dynamic shared memory at most
STAGES = 1  # chunk buffers a block (2: one block an SM; the same sums, see SOURCE)

SOURCE = r"""
  // Block: (b * H + h) * (DV / JB) + column block; N chunks of C tokens; state slice S^T[:, j0 : j0 + JB]. N is
  // read, not a template value: a prompt of any length compiles nothing new.
  const int N = chunks[0];
  // ST 2: two buffers, chunk i + 1 copied while chunk i computes. ST 1: one buffer (half the shared memory, two
  // blocks an SM), chunk i + 1's W and U~ copied during chunk i's state update, its KD during its own U.
  // MMA 1: both products on the tensor cores (mma.sync m16n8k8, each float32 operand split into two TF32 parts,
  // three products a tile: float32's accuracy to a few units); rows padded so fragments read 32 banks.
  constexpr int DKP = DK + 4;                       // W's rows padded: two rows a warp read, other banks
  constexpr int STS = MMA ? JB + 8 : JB, KDS = MMA ? DK + 8 : DK;  // S^T's and U's rows, KD's rows
  const int bh = blockIdx.x / (DV / JB), j0 = (blockIdx.x % (DV / JB)) * JB;
  const int t = threadIdx.x, warp = t / 32, lg = (t % 32) / 4, lt = t % 4;  // (lg, lt): a fragment's row, column
  extern __shared__ __align__(16) float engine_smem[];
  float* s_st = engine_smem;                        // [DK][STS]: S^T's columns j0.. at the current chunk's start
  float* s_u = s_st + DK * STS;                     // [C][STS]: this chunk's U
  float* s_w = s_u + C * STS;                       // ST x [C][DKP]
  float* s_kd = s_w + ST * C * DKP;                 // ST x [C][KDS]
  float* s_ut = s_kd + ST * C * KDS;                // ST x [C][JB]

  auto copy_wu = [&](const int i, const int buf) {  // chunk i's W and U~ columns into buffer buf
    const size_t chunk = (size_t)bh * N + i;
    const float* w_src = w + chunk * C * DK;
    const float* ut_src = u_tilde + chunk * C * DV + j0;
    for (int e = t; e < C * DK / 4; e += NT) {
      const int c = e / (DK / 4), d = (e % (DK / 4)) * 4;
      engine_cp16(s_w + (buf * C + c) * DKP + d, w_src + c * DK + d);
    }
    for (int e = t; e < C * JB / 4; e += NT) {
      const int c = e / (JB / 4), j = (e % (JB / 4)) * 4;
      engine_cp16(s_ut + (buf * C + c) * JB + j, ut_src + (size_t)c * DV + j);
    }
  };
  auto copy_kd = [&](const int i, const int buf) {  // chunk i's KD into buffer buf
    const float* kd_src = kd + ((size_t)bh * N + i) * C * DK;
    for (int e = t; e < C * DK / 4; e += NT) {
      const int c = e / (DK / 4), d = (e % (DK / 4)) * 4;
      engine_cp16(s_kd + (buf * C + c) * KDS + d, kd_src + c * DK + d);
    }
  };
  auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };

  copy_wu(0, 0);
  if constexpr (ST == 1) commit();
  copy_kd(0, 0);
  commit();
  const auto* s_in = state + (size_t)bh * DV * DK;  // [DV][DK]: S, read transposed
  for (int e = t; e < DK * JB; e += NT) {
    const int d = e % DK, j = e / DK;
    s_st[d * STS + j] = (float)s_in[(size_t)(j0 + j) * DK + d];
  }
  if constexpr (ST == 1) {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
    __syncthreads();
  }

  for (int i = 0; i < N; ++i) {
    const int buf = ST == 2 ? (i & 1) : 0;
    if constexpr (ST == 2) {
      asm volatile("cp.async.wait_all;" ::: "memory");
      __syncthreads();                              // chunk i landed; the state and U of chunk i - 1 written
      if (i + 1 < N) {                              // the buffer chunk i - 1 used: its readers passed the barrier
        copy_wu(i + 1, buf ^ 1);
        copy_kd(i + 1, buf ^ 1);
        commit();
      }
    }
    const float* cw = s_w + buf * C * DKP;
    const float* ckd = s_kd + buf * C * KDS;
    const float* cut = s_ut + buf * C * JB;
    const size_t chunk = (size_t)bh * N + i;

    // U = U~ - W S^T: an item is 4 rows c x 2 columns j, its sums over k in order (MMA: a warp a 16 x 8 tile).
    if constexpr (MMA) {
      for (int tile = warp; tile < (C / 16) * (JB / 8); tile += NT / 32) {
        const int m0 = (tile / (JB / 8)) * 16, n0 = (tile % (JB / 8)) * 8;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        #pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
          const float a[4] = {cw[(m0 + lg) * DKP + k0 + lt], cw[(m0 + lg + 8) * DKP + k0 + lt],
                              cw[(m0 + lg) * DKP + k0 + lt + 4], cw[(m0 + lg + 8) * DKP + k0 + lt + 4]};
          const float b[2] = {s_st[(k0 + lt) * STS + n0 + lg], s_st[(k0 + lt + 4) * STS + n0 + lg]};
          engine_mma_split(acc, a, b);
        }
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + lg + 8 * half, col = n0 + 2 * lt;
          const float2 ut = *reinterpret_cast<const float2*>(cut + row * JB + col);
          const float2 u2 = make_float2(ut.x - acc[2 * half], ut.y - acc[2 * half + 1]);
          *reinterpret_cast<float2*>(s_u + row * STS + col) = u2;
          *reinterpret_cast<float2*>(us + (chunk * C + row) * DV + j0 + col) = u2;
        }
      }
    }
    for (int e = t; !MMA && e < (C / 4) * (JB / 2); e += NT) {
      const int c0 = (e / (JB / 2)) * 4, j = (e % (JB / 2)) * 2;
      float acc[4][2] = {};
      for (int d = 0; d < DK; d += 4) {
        float4 wv[4];
        #pragma unroll
        for (int r = 0; r < 4; ++r) wv[r] = *reinterpret_cast<const float4*>(cw + (c0 + r) * DKP + d);
        float2 sv[4];
        #pragma unroll
        for (int q = 0; q < 4; ++q) sv[q] = *reinterpret_cast<const float2*>(s_st + (d + q) * STS + j);
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float wr[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
          #pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[r][0] = fmaf(wr[q], sv[q].x, acc[r][0]);
            acc[r][1] = fmaf(wr[q], sv[q].y, acc[r][1]);
          }
        }
      }
      #pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float2 ut = *reinterpret_cast<const float2*>(cut + (c0 + r) * JB + j);
        const float2 u2 = make_float2(ut.x - acc[r][0], ut.y - acc[r][1]);
        *reinterpret_cast<float2*>(s_u + (c0 + r) * STS + j) = u2;
        *reinterpret_cast<float2*>(us + (chunk * C + c0 + r) * DV + j0 + j) = u2;
      }
    }
    if constexpr (ST == 1) asm volatile("cp.async.wait_all;" ::: "memory");  // chunk i's KD
    __syncthreads();                                // U whole; the state still the chunk's start
    if constexpr (ST == 1) {
      if (i + 1 < N) {                              // W's and U~'s readers passed the barrier
        copy_wu(i + 1, 0);
        commit();
      }
    }

    // S^T <- c S^T + KD^T U: an item is 4 rows d x 4 columns j, its sums over the chunk's rows in order; the
    // state at the chunk's start is written out first.
    const float decay = chunk_decay[chunk];
    if constexpr (MMA) {
      for (int tile = warp; tile < (DK / 16) * (JB / 8); tile += NT / 32) {
        const int m0 = (tile / (JB / 8)) * 16, n0 = (tile % (JB / 8)) * 8;
        float acc[4];
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + lg + 8 * half, col = n0 + 2 * lt;
          const float2 s2 = *reinterpret_cast<const float2*>(s_st + row * STS + col);
          *reinterpret_cast<float2*>(starts + (chunk * DK + row) * DV + j0 + col) = s2;
          acc[2 * half] = decay * s2.x;
          acc[2 * half + 1] = decay * s2.y;
        }
        #pragma unroll
        for (int k0 = 0; k0 < C; k0 += 8) {         // A = KD^T (rows d, columns the chunk's rows), B = U
          const float a[4] = {ckd[(k0 + lt) * KDS + m0 + lg], ckd[(k0 + lt) * KDS + m0 + lg + 8],
                              ckd[(k0 + lt + 4) * KDS + m0 + lg], ckd[(k0 + lt + 4) * KDS + m0 + lg + 8]};
          const float b[2] = {s_u[(k0 + lt) * STS + n0 + lg], s_u[(k0 + lt + 4) * STS + n0 + lg]};
          engine_mma_split(acc, a, b);
        }
        #pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m0 + lg + 8 * half, col = n0 + 2 * lt;
          *reinterpret_cast<float2*>(s_st + row * STS + col) = make_float2(acc[2 * half], acc[2 * half + 1]);
        }
      }
    }
    for (int e = t; !MMA && e < (DK / 4) * (JB / 4); e += NT) {
      const int d0 = (e / (JB / 4)) * 4, j = (e % (JB / 4)) * 4;
      float4 acc[4];
      #pragma unroll
      for (int r = 0; r < 4; ++r) {
        acc[r] = *reinterpret_cast<const float4*>(s_st + (d0 + r) * STS + j);
        *reinterpret_cast<float4*>(starts + (chunk * DK + d0 + r) * DV + j0 + j) = acc[r];
        acc[r] = make_float4(decay * acc[r].x, decay * acc[r].y, decay * acc[r].z, decay * acc[r].w);
      }
      for (int c = 0; c < C; ++c) {
        const float4 kv = *reinterpret_cast<const float4*>(ckd + c * KDS + d0);
        const float4 uv = *reinterpret_cast<const float4*>(s_u + c * STS + j);
        const float kr[4] = {kv.x, kv.y, kv.z, kv.w};
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
          acc[r].x = fmaf(kr[r], uv.x, acc[r].x);
          acc[r].y = fmaf(kr[r], uv.y, acc[r].y);
          acc[r].z = fmaf(kr[r], uv.z, acc[r].z);
          acc[r].w = fmaf(kr[r], uv.w, acc[r].w);
        }
      }
      #pragma unroll
      for (int r = 0; r < 4; ++r) *reinterpret_cast<float4*>(s_st + (d0 + r) * STS + j) = acc[r];
    }
    if constexpr (ST == 1) {
      if (i + 1 < N) {
        __syncthreads();                            // KD's readers done
        copy_kd(i + 1, 0);
        commit();
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // chunk i + 1's W and U~ (its KD may still come)
      }
      __syncthreads();
    }
  }
  __syncthreads();
  for (int e = t; e < DK * JB; e += NT) {           // the final state as S [DV][DK]
    const int d = e % DK, j = e / DK;
    final_state[((size_t)bh * DV + j0 + j) * DK + d] = s_st[d * STS + j];
  }
"""

HEADER = (
    CP_ASYNC16
    + r"""
// x as a TF32 value and the TF32 value of what it leaves (x = hi + lo to ~2^-22 of x)
__device__ __forceinline__ void engine_tf32_split(const float x, uint32_t& hi, uint32_t& lo) {
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
  const float rest = x - __uint_as_float(hi);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(rest));
}
// d += a b for a 16 x 8 TF32 A fragment (a0: row g col t, a1: g + 8 / t, a2: g / t + 4, a3: g + 8 / t + 4) and an
// 8 x 8 B fragment (b0: row t col g, b1: t + 4 / g); d: rows g, g + 8, columns 2t, 2t + 1 (g = lane / 4, t = lane % 4)
__device__ __forceinline__ void engine_mma_tf32(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// d += a b for float32 fragments (the layouts above) as split TF32: a_lo b_hi, a_hi b_lo, then a_hi b_hi
__device__ __forceinline__ void engine_mma_split(float* d, const float (&a)[4], const float (&b)[2]) {
  uint32_t ah[4], al[4], bh[2], bl[2];
  #pragma unroll
  for (int i = 0; i < 4; ++i) engine_tf32_split(a[i], ah[i], al[i]);
  #pragma unroll
  for (int i = 0; i < 2; ++i) engine_tf32_split(b[i], bh[i], bl[i]);
  engine_mma_tf32(d, al, bh);
  engine_mma_tf32(d, ah, bl);
  engine_mma_tf32(d, ah, bh);
}
"""
)


def column_block(dk: int, dv: int, stages: int = STAGES, mma: bool = False) -> int | None:
    """The value columns a block takes (32, else 16, 8 or 4 that divide Dv; with `mma` at least 8), or None where
    the kernel cannot run heads of key dim `dk` and value dim `dv` (Dk not a multiple of 4, or of 16 with `mma`,
    or its shared memory too large)."""
    if dk % (16 if mma else 4):
        return None
    for jb in (32, 16, 8) if mma else (32, 16, 8, 4):
        if dv % jb == 0 and shared_bytes(dk, jb, stages, mma=mma) <= MAX_SHARED:
            return jb
    return None


def shared_bytes(dk: int, jb: int, stages: int = STAGES, chunk: int = 64, mma: bool = False) -> int:
    """The dynamic shared memory of a block: the state's slice, U, and `stages` buffers of W (rows padded), KD
    and U~ (with `mma`, the state's, U's and KD's rows padded too)."""
    pad = 8 if mma else 0
    return 4 * ((dk + chunk) * (jb + pad) + stages * chunk * (dk + 4 + dk + pad + jb))


@cache
def _kernel(shared: int, stages: int):
    return cuda_kernel(
        name="engine_gated_delta_states",
        input_names=["u_tilde", "w", "kd", "chunk_decay", "state", "chunks"],
        output_names=["starts", "us", "final_state"],
        source=SOURCE,
        header=HEADER + launch_bounds(THREADS, 3 - stages),
        shared_memory=shared,
    )


def chunk_states(
    u_tilde: mx.array,
    w: mx.array,
    k_decayed: mx.array,
    chunk_decay: mx.array,
    state: mx.array,
    stages: int = STAGES,
    mma: bool = False,
) -> tuple[mx.array, mx.array, mx.array]:
    """u_tilde [B, H, N, C, Dv], w and k_decayed [B, H, N, C, Dk], chunk_decay [B, H, N] (float32), state
    [B, H, Dv, Dk] in any float dtype: (S^T at each chunk's start [B, H, N, Dk, Dv], U [B, H, N, C, Dv], the
    state after the last chunk [B, H, Dv, Dk]), all float32; `mma`: the products on the tensor cores (split
    TF32, not yet timed). CUDA only; ValueError for heads it cannot take."""
    b, h, n, c, dv = u_tilde.shape
    dk = w.shape[-1]
    jb = column_block(dk, dv, stages, mma)
    if jb is None or c % (16 if mma else 4) or stages not in (1, 2):
        raise ValueError(f"no chunk-states kernel for key dim {dk}, value dim {dv}, chunks of {c}, {stages} stages")
    shared = shared_bytes(dk, jb, stages, c, mma)
    f32 = mx.float32
    starts, us, final = _kernel(shared, stages)(
        inputs=[
            u_tilde.astype(f32),
            w.astype(f32),
            k_decayed.astype(f32),
            chunk_decay.astype(f32),
            state,
            mx.array([n], dtype=mx.int32),
        ],
        template=[("C", c), ("DK", dk), ("DV", dv), ("JB", jb), ("NT", THREADS), ("ST", stages), ("MMA", int(mma))],
        grid=(b * h * (dv // jb) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, h, n, dk, dv), (b, h, n, c, dv), (b, h, dv, dk)],
        output_dtypes=[f32, f32, f32],
    )
    return starts, us, final
