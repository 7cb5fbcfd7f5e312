"""A 4-bit matmul for up to 64 activation rows on Hopper's warpgroup MMA (`wgmma`): the staged launches' split
parts where a layout asks for it (`StagedConfig.wgmma`, layout key WG; off by default, not yet run on a GPU;
docs/kernels.md, "Batched rows").

At 64 rows the staged kernel's `mma.sync` products wait on latency with 12 warps an SM, ~5 instructions a
16x8x16 product. Here one warpgroup (4 warps) takes 128 weight rows of a split of K: each chunk (128 k values)
of the M activation rows, the block's weight words, scales and biases lands in shared memory by `cp.async`, the
activations laid out as wgmma's core matrices (8 rows of 16 bytes, K-major, no swizzle), so the tensor cores
read them from there with no register or shuffle work; every thread turns its share of the weights into bf16
round(q * scale + bias) (the staged kernel's rounded arithmetic, one rounding) as wgmma's A fragments in
registers, one 16-k step ahead of the products in flight. Each split writes float32 partial sums [S, M, NT] of
one or more matrices (their rows one after another, NT in all) where the staged kernel's split launch writes
them, so its sums launch adds them and runs the fused stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import mlx.core as mx

from engine.kernels.cuda_source import cuda_kernel
from engine.kernels.quantized_gemv.source import HEADER, input_names, launch_bounds, matrix_choice

ROWS = 128  # weight rows a block: two 64-row wgmma tiles
KC = 128  # k values a chunk (two groups of 64)
STAGES = 2
WS = KC // 8 + 4  # words a weight row in shared memory: 16, padded (16-byte loads of rows g = 0..7: 2 phases)
W_STAGE = ROWS * WS * 4
SB_STAGE = ROWS * 2 * 2 * 2  # two groups' scales, then biases, bf16


def columns(m: int) -> int:
    """Activation rows a product takes (wgmma's N): 32 up to 32 rows (half the tensor-core work), else 64."""
    return 32 if m <= 32 else 64


def shared_bytes(cols: int) -> int:
    """A block's stages: a chunk's activations (cols / 8 row groups x 16 k units, a 128-byte core matrix each),
    weight words, scales and biases."""
    return STAGES * (cols * KC * 2 + W_STAGE + SB_STAGE)


def _mma(cols: int) -> str:
    """engine_wg_mma: D[64 x cols] += A (registers) x B (shared, K-major), bf16 in, float32 out."""
    acc = cols // 2
    regs = ", ".join(f"%{i}" for i in range(acc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
    return rf"""
__device__ __forceinline__ void engine_wg_mma(float (&d)[{acc}], const uint32_t (&a)[4], uint64_t desc) {{
  asm volatile(
      "{{\n.reg .pred p;\nsetp.ne.b32 p, %{acc + 5}, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n{cols}k16.f32.bf16.bf16 "
      "{{{regs}}}, {{%{acc}, %{acc + 1}, %{acc + 2}, %{acc + 3}}}, %{acc + 4}, p, 1, 1, 0;\n}}\n"
      : {outs}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}}
"""


_HEADER = r"""
__device__ __forceinline__ uint32_t engine_wg_pair(uint32_t word, uint32_t t, __nv_bfloat162 scale,
                                                   __nv_bfloat162 bias) {
  // values 2t and 2t + 1 of a 4-bit word (its byte t) as bf16 round(q * scale + bias), low half value 2t
  uint32_t v = __byte_perm(word, 0u, 0x4440u | t);  // byte t alone
  v *= 0x1001u;                                     // its high nibble also at bits 16-19
  asm("lop3.b32 %0, %0, %1, %2, 0xEA;" : "+r"(v) : "r"(0x000F000Fu), "r"(0x43004300u));
  __nv_bfloat162 q = *reinterpret_cast<const __nv_bfloat162*>(&v);
  q = __hsub2(q, __float2bfloat162_rn(128.0f));
  const __nv_bfloat162 w = __hfma2(q, scale, bias);
  return *reinterpret_cast<const uint32_t*>(&w);
}
__device__ __forceinline__ uint64_t engine_wg_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  // a no-swizzle shared-memory matrix descriptor: start, leading (K) and stride (M/N) byte offsets, each / 16
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}
template <int A>
__device__ __forceinline__ void engine_wg_hold(float (&d)[A]) {
  // the accumulators as the compiler must see them across wgmma's asynchronous writes (no read moved over)
  #pragma unroll
  for (int i = 0; i < A; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
"""

_SOURCE = r"""
  constexpr int ROWS = 128, KC = 128, ST = 2, WS = KC / 8 + 4, GS = 64, STEPS = KC / 16;
  constexpr int X_STAGE = NC * KC * 2, XU = NC * 16, W_STAGE = ROWS * WS * 4, STAGE = X_STAGE + W_STAGE + ROWS * 8;
  constexpr int KS = K / S, CHUNKS = KS / KC, WORDS = K / 8, GROUPS = K / GS;
  static_assert(KS % KC == 0, "a split takes whole chunks");
  extern __shared__ __align__(128) unsigned char engine_stages[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
  const uint32_t t = lane & 3;
  const int split = blockIdx.x % S, row0 = blk * ROWS;
  const int k_first = split * KS;
  // Chunk c into stage b: activation row m's k unit u (8 values) to core matrix (u, m / 8), its row m % 8
  // (16 bytes; core matrices 128 bytes, u after u: XU bytes apart); rows past M are not copied (their
  // products reach only columns that are not stored). Weight rows past N copy row N - 1.
  auto issue = [&](const int c) {
    if (c < CHUNKS) {
      unsigned char* st = engine_stages + (c % ST) * STAGE;
      const int k0 = k_first + c * KC;
      #pragma unroll
      for (int j = 0; j < NC / 8; ++j) {  // a warp: 8 rows of one row group, 4 k units each (64 bytes a row)
        const int i = tid + 128 * j, u = (i / (NC * 4)) * 4 + (i / 8) % 4, m = ((i / 32) % (NC / 8)) * 8 + i % 8;
        if (m < M) engine_cp16(st + u * XU + (m / 8) * 128 + (m % 8) * 16, x + (size_t)m * K + k0 + u * 8);
      }
      uint32_t* sw = reinterpret_cast<uint32_t*>(st + X_STAGE);
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = tid / 4 + 32 * j, v = tid % 4;
        engine_cp16(sw + r * WS + v * 4, w + (size_t)min(row0 + r, N - 1) * WORDS + k0 / 8 + v * 4);
      }
      __nv_bfloat16* ss = reinterpret_cast<__nv_bfloat16*>(st + X_STAGE + W_STAGE);
      const size_t at = (size_t)min(row0 + tid, N - 1) * GROUPS + k0 / GS;
      engine_cp4(ss + tid * 2, scales + at);
      engine_cp4(ss + ROWS * 2 + tid * 2, biases + at);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  float d[2][NC / 2];
  #pragma unroll
  for (int r = 0; r < 2; ++r)
    #pragma unroll
    for (int i = 0; i < NC / 2; ++i) d[r][i] = 0.0f;
  engine_wg_hold(d[0]);
  engine_wg_hold(d[1]);
  uint32_t a[2][2][4];  // [buffer][tile]: a 16-k step's A fragments, one step ahead
  // Tile r's rows: R0 = r * 64 + warp * 16 + g and R0 + 8; their A fragments at step s: k 16 s + 2t (+1) and
  // 16 s + 8 + 2t (+1), byte t of their words 2 s and 2 s + 1. Their scales and biases change every 4 steps.
  const int wrow = (warp * 16 + g) * WS, srow = (warp * 16 + g) * 2;
  __nv_bfloat162 sc[2][2], bi[2][2];  // [tile][row g, g + 8]
  uint4 words[2][2];                  // [tile][row]: the words of two steps
  auto fragments = [&](uint32_t (&f)[2][4], const unsigned char* st, const int s) {
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(st + X_STAGE) + wrow;
    const __nv_bfloat16* ss = reinterpret_cast<const __nv_bfloat16*>(st + X_STAGE + W_STAGE) + srow;
    if (s % (GS / 16) == 0) {
      const int grp = s * 16 / GS;
      #pragma unroll
      for (int r = 0; r < 2; ++r)
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int at = (r * 64 + h * 8) * 2 + grp;
          sc[r][h] = __bfloat162bfloat162(ss[at]);
          bi[r][h] = __bfloat162bfloat162(ss[ROWS * 2 + at]);
        }
    }
    if (s % 2 == 0)
      #pragma unroll
      for (int r = 0; r < 2; ++r)
        #pragma unroll
        for (int h = 0; h < 2; ++h) words[r][h] = *reinterpret_cast<const uint4*>(sw + (r * 64 + h * 8) * WS + 2 * s);
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t lo0 = s % 2 ? words[r][0].z : words[r][0].x, hi0 = s % 2 ? words[r][0].w : words[r][0].y;
      const uint32_t lo1 = s % 2 ? words[r][1].z : words[r][1].x, hi1 = s % 2 ? words[r][1].w : words[r][1].y;
      f[r][0] = engine_wg_pair(lo0, t, sc[r][0], bi[r][0]);
      f[r][1] = engine_wg_pair(lo1, t, sc[r][1], bi[r][1]);
      f[r][2] = engine_wg_pair(hi0, t, sc[r][0], bi[r][0]);
      f[r][3] = engine_wg_pair(hi1, t, sc[r][1], bi[r][1]);
    }
  };

  issue(0);
  #pragma unroll 1
  for (int c = 0; c < CHUNKS; ++c) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the copies, seen by wgmma's async reads
    __syncthreads();
    issue(c + 1);
    const unsigned char* st = engine_stages + (c % ST) * STAGE;
    fragments(a[0], st, 0);
    #pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      #pragma unroll
      for (int r = 0; r < 2; ++r)
        engine_wg_mma(d[r], a[s & 1][r], engine_wg_desc(st + 2 * s * XU, LBO, SBO));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      if (s + 1 < STEPS) {
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // step s - 1 done: its buffer is free
        fragments(a[(s + 1) & 1], st, s + 1);
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");  // the stage is free for chunk c + 2
    engine_wg_hold(d[0]);
    engine_wg_hold(d[1]);
  }
  // d[r][4j + i]: weight row r * 64 + warp * 16 + g + 8 (i / 2), activation row 8 j + 2 t + i % 2
  #pragma unroll
  for (int r = 0; r < 2; ++r)
    #pragma unroll
    for (int j = 0; j < NC / 8; ++j)
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = 8 * j + 2 * (int)t + (i & 1), n = row0 + r * 64 + warp * 16 + g + 8 * (i >> 1);
        if (m < M && n < N) part[((size_t)split * M + m) * NT + off + n] = d[r][4 * j + i];
      }
"""

# The activations' core matrices: row group after row group 128 bytes apart (N, the stride dimension); k unit after
# k unit 16 bytes a column apart (K, the leading dimension: `lbo(cols)`).
SBO = 128


def lbo(cols: int) -> int:
    return cols * 16


def _prologue(count: int) -> str:
    """Which of the `count` matrices a block takes (row blocks matrix after matrix, matrix i's from BLK{i}) and
    where its rows start in the parts (`off`)."""
    lines = [
        "  const uint32_t* w; const __nv_bfloat16* scales; const __nv_bfloat16* biases;",
        "  int N, off, blk = blockIdx.x / S;",
    ] + matrix_choice(count, outputs=False, offsets=True)
    return "\n".join(lines) + "\n"


def takes(m: int, k: int, group_size: int, bits: int, n_splits: int) -> bool:
    """Whether the kernel computes M rows against K inputs split `n_splits` ways: up to 64 rows, 4 bits, group 64,
    each split whole chunks."""
    return m <= 64 and bits == 4 and group_size == 64 and k % n_splits == 0 and k // n_splits % KC == 0


@cache
def _kernel(count: int, min_blocks: int, cols: int):
    return cuda_kernel(
        name=f"engine_wgmma_q4_{count}",
        input_names=input_names(count),
        output_names=["part"],
        source=_prologue(count) + _SOURCE,
        header=HEADER + launch_bounds(128, min_blocks) + _HEADER + _mma(cols),
        shared_memory=shared_bytes(cols),
    )


def wgmma_parts(
    x: mx.array,
    matrices: Sequence[tuple[mx.array, mx.array, mx.array]],
    n_splits: int,
    min_blocks: int = 3,
    offsets: tuple[int, int] | None = None,
) -> mx.array:
    """x [..., K] bf16 (at most 64 rows) times each 4-bit, group-64 matrix (w [N_i, K / 8] uint32, scales and biases
    [N_i, K / 64] bf16) transposed: float32 partial sums [S, M, NT] over S = `n_splits` even splits of K, the
    matrices' rows one after another (NT their sum); at least `min_blocks` blocks an SM (registers capped to fit;
    0: uncapped); `offsets`: the activations' descriptor offsets, leading and stride (default `lbo(cols)`, SBO;
    for trying the other reading of the layout)."""
    k = x.shape[-1]
    m = x.size // k
    rows = [w.shape[0] for w, _, _ in matrices]
    shapes_ok = all(w.shape[1] * 8 == k and s.shape[1] * 64 == k for w, s, _ in matrices)
    if not shapes_ok or not takes(m, k, 64, 4, n_splits):
        raise ValueError(f"wgmma_parts takes up to 64 rows at 4 bits, group 64, and splits of K in {KC}-value chunks")
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + -(-n // ROWS))
    cols = columns(m)
    leading, stride = offsets or (lbo(cols), SBO)
    template = [("M", m), ("K", k), ("S", n_splits), ("NT", sum(rows)), ("NC", cols), ("LBO", leading), ("SBO", stride)]
    template += [(f"N{i}", n) for i, n in enumerate(rows)] + [(f"BLK{i}", b) for i, b in enumerate(starts[:-1])]
    return _kernel(len(matrices), min_blocks, cols)(
        inputs=[x] + [a for triple in matrices for a in triple],
        template=template,
        output_shapes=[(n_splits, m, sum(rows))],
        output_dtypes=[mx.float32],
        grid=(starts[-1] * n_splits * 128, 1, 1),
        threadgroup=(128, 1, 1),
    )[0]
