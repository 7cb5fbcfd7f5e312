"""The GEMV kernel's CUDA source: the body every launch shares, and which matrix a block takes.

The weights go through `mma.sync` (m16n8k16, bf16 in, float32 out) as exact
small integers: a nibble OR-ed into the mantissa of bf16 128 (one LOP3 a pair
of values), the 128 taken out once a k-tile through the bias term. The
activations are the 16x8 B operand, one 8-row column block per 8 activation
rows (M <= 64: up to 8 blocks); lane (g, t) of a warp feeds rows g and g + 8
of a 16-row tile with its own words of each row, so no data moves between
lanes. Each k-tile lies in one quantization group: its products are summed on
the tensor core, then `acc += scale * sum((128 + q) x) + (bias - 128 * scale)
* sum(x)` in float32. A block's W warps form WR row groups of W / WR warps:
a group's warps split K, each issuing U k-tiles of loads before its first
multiply, and the partial sums meet in shared memory. More row groups a block
mean fewer blocks reading all M activation rows (from L2), which at 16-64 rows
outweighs the weights. At many rows a group's warps also split the activation
rows (WM slices of 8-row blocks, each warp loading the same weights, which the
others then find in L1): a warp holds a slice's sums, not all M rows', so more
warps fit an SM to hide the loads' latency. No split changes a sum's order. The stages a launch adds around its products
(`fusion.Fusion`) fill in the marked places.
"""

from __future__ import annotations

from functools import cache

from engine.kernels.cuda_source import CP_ASYNC16, MMA_BF16, TO_BF16X2, cuda_kernel
from engine.kernels.quantized_gemv.fusion import Fusion

HEADER = (
    "#include <cuda_bf16.h>\n"
    + CP_ASYNC16
    + r"""
// cp.async copies of 4 bytes into shared memory (CP_ASYNC16: of 16)
__device__ __forceinline__ void engine_cp4(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(d), "l"(src) : "memory");
}
template <int WL> struct engine_words { using type = uint2; };
template <> struct engine_words<1> { using type = uint32_t; };
template <int U> struct engine_scale_vec { using type = uint2; };   // 4 bf16
template <> struct engine_scale_vec<8> { using type = uint4; };     // 8 bf16
"""
    + MMA_BF16
    + r"""
__device__ __forceinline__ float2 engine_bf16x2(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
"""
    + TO_BF16X2
    + r"""
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
template <int BITS>
__device__ __forceinline__ uint32_t engine_dequant(uint32_t word, int j, __nv_bfloat162 scale, __nv_bfloat162 bias) {
  // values j and j + 16 / BITS of a word as bf16 round(q * scale + bias), rounded once (as MLX's dequantize on
  // sm_90, where ptxas fuses its product and sum; its sm_80 code rounds each)
  const uint32_t v = engine_pair<BITS>(word, j);
  __nv_bfloat162 q = *reinterpret_cast<const __nv_bfloat162*>(&v);
  if constexpr (BITS == 4) q = __hsub2(q, __float2bfloat162_rn(128.0f));  // exact: small integers
  const __nv_bfloat162 w = __hfma2(q, scale, bias);
  return *reinterpret_cast<const uint32_t*>(&w);
}
"""
)

_BODY_START = r"""
  // Threads: W warps in WR row groups of WK x WM, a group's warps on the same 16 * RT weight rows, splitting
  // K (WK) and the 8-row blocks of activation rows (WM slices of NBW). Lane (g, t) = (lane / 4, lane % 4).
  constexpr int PW = 32 / BITS;                     // values per 32-bit word
  constexpr int HALF = PW / 2;
  constexpr int SPW = PW / 4;                       // mma steps (16 k values) per word
  constexpr int WL = GS * BITS / 128 < 2 ? GS * BITS / 128 : 2;  // words per lane per row in one k-tile
  constexpr int TILE_K = 4 * WL * PW;               // a k-tile: 4 lanes x WL words, inside one group
  constexpr int KT = K / TILE_K;
  constexpr int STEPS = WL * SPW;
  constexpr int XR = WL * PW / 2;                   // activation registers (bf16 pairs) per lane and tile
  constexpr int NB = (M + 7) / 8;                   // 8-column blocks of activation rows
  constexpr int THREADS = W * 32;                   // a block's threads (the fused stages' loops)
  constexpr int WK = W / (WR * WM);                 // warps of a row group splitting K (per slice)
  static_assert(W % (WR * WM) == 0, "row groups of equal warps");
  constexpr int NBW = (NB + WM - 1) / WM;           // 8-row blocks a warp's slice takes
  constexpr int WORDS_PER_ROW = K / PW;
  constexpr int GROUPS_PER_ROW = K / GS;
  using Words = typename engine_words<WL>::type;
  // Scales and biases of a batch in one load when each k-tile is one group and batches stay aligned.
  constexpr bool VEC_SCALES = TILE_K == GS && (U == 4 || U == 8) && GROUPS_PER_ROW % U == 0;
  using ScaleVec = typename engine_scale_vec<U>::type;

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp % WM, wk = (warp / WM) % WK, wr = warp / (WM * WK);
  const int slot = warp / WM;                       // the warp's partial sums in _REDUCE: wr * WK + wk
  const int block_base = blk * WR * 16 * RTO;       // the block's first output row
  const int row_base = block_base + wr * 16 * RTO;  // its row group's
  auto tile_row = [&](const int r) { return row_base + (r % RTO) * 16; };  // row tile r's first row
  const uint32_t ones = 0x3F803F80u;                // bf16 (1, 1)
  // FUSED STAGES

  float acc[RT][NBW][4];
  #pragma unroll
  for (int r = 0; r < RT; ++r)
    #pragma unroll
    for (int nb = 0; nb < NBW; ++nb)
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
        // The activations of this warp's slice as mma B fragments, and their sums (the bias term), for all
        // its 8-row blocks; then each row tile's weights dequantized once, against every block.
        uint32_t xb[NBW][STEPS][2];
        float xs[NBW][4];
        #pragma unroll
        for (int nbl = 0; nbl < NBW; ++nbl) {
          const int nb = wm * NBW + nbl;
          // The dot product's k order is free: lane t's k-tile values (its own WL words) feed its four B
          // slots of each step in the order the weights' pairs come.
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
              xb[nbl][wi * SPW + h][0] = __byte_perm(xr[a], xr[a + HALF / 2], 0x5410);  // x[2h], x[2h + HALF]
              xb[nbl][wi * SPW + h][1] = __byte_perm(xr[a], xr[a + HALF / 2], 0x7632);  // x[2h + 1], x[2h + 1 + HALF]
            }
          // sum(x) over the tile per activation row, in the accumulator layout
          #pragma unroll
          for (int i = 0; i < 4; ++i) xs[nbl][i] = 0.0f;
          #pragma unroll
          for (int st = 0; st < STEPS; ++st) engine_mma(xs[nbl], ones, ones, ones, ones, xb[nbl][st][0], xb[nbl][st][1]);
        }
        #pragma unroll
        for (int r = 0; r < RT; ++r) {
          const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&bt.wq[u][r][0]);
          const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&bt.wq[u][r][1]);
          uint32_t wa[STEPS][4];
          #pragma unroll
          for (int wi = 0; wi < WL; ++wi)
            #pragma unroll
            for (int h = 0; h < SPW; ++h) {
              wa[wi * SPW + h][0] = engine_pair<BITS>(w0[wi], 2 * h);
              wa[wi * SPW + h][1] = engine_pair<BITS>(w1[wi], 2 * h);
              wa[wi * SPW + h][2] = engine_pair<BITS>(w0[wi], 2 * h + 1);
              wa[wi * SPW + h][3] = engine_pair<BITS>(w1[wi], 2 * h + 1);
            }
          const float s0 = __bfloat162float(bt.sc[u][r][0]), s1 = __bfloat162float(bt.sc[u][r][1]);
          // the bias term less the offset engine_pair put in every weight value: sum((q + o) x) = sum(q x) + o sum(x)
          constexpr float o = engine_offset<BITS>::value;
          const float b0 = fmaf(-o, s0, __bfloat162float(bt.bi[u][r][0])), b1 = fmaf(-o, s1, __bfloat162float(bt.bi[u][r][1]));
          #pragma unroll
          for (int nbl = 0; nbl < NBW; ++nbl) {
            if (NBW * WM > NB && wm * NBW + nbl >= NB) continue;  // the last slice's blocks past M (uniform in the warp)
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int st = 0; st < STEPS; ++st)
              engine_mma(d, wa[st][0], wa[st][1], wa[st][2], wa[st][3], xb[nbl][st][0], xb[nbl][st][1]);
            acc[r][nbl][0] = fmaf(s0, d[0], fmaf(b0, xs[nbl][0], acc[r][nbl][0]));
            acc[r][nbl][2] = fmaf(s1, d[2], fmaf(b1, xs[nbl][2], acc[r][nbl][2]));
            if constexpr (M > 1) {  // odd accumulators hold columns 2t + 1: never an activation row at M = 1
              acc[r][nbl][1] = fmaf(s0, d[1], fmaf(b0, xs[nbl][1], acc[r][nbl][1]));
              acc[r][nbl][3] = fmaf(s1, d[3], fmaf(b1, xs[nbl][3], acc[r][nbl][3]));
            }
          }
        }
      }
    }
  };

"""

_LOOP_REGISTERS = r"""
  // Warp wk of a row group takes U consecutive k-tiles at a time, every WK * U tiles.
  #pragma unroll 1
  for (int kt0 = wk * U; kt0 < KT; kt0 += WK * U) {
    Batch bt;
    load(bt, kt0);
    multiply(bt, kt0);
  }

"""

_REDUCE = r"""
  // ROW SCALE
  // Sum a row group's WK warps' partial products (a slot each, its WM warps writing their own columns);
  // accumulator i of lane (g, t): row g + 8 * (i / 2), column 2t + i % 2. A row's columns are one apart (+1:
  // the sums below read a row a thread, without bank conflicts).
  __shared__ float red[WR * WK][16 * RT][8 * NB + 1];
  #pragma unroll
  for (int r = 0; r < RT; ++r)
    #pragma unroll
    for (int nbl = 0; nbl < NBW; ++nbl) {
      const int nb = wm * NBW + nbl;
      if (nb < NB)
        #pragma unroll
        for (int i = 0; i < 4; ++i) red[slot][r * 16 + g + 8 * (i / 2)][nb * 8 + 2 * t + i % 2] = acc[r][nbl][i];
    }
  __syncthreads();
  // consecutive threads take consecutive output rows of one activation row: coalesced stores
  constexpr int GROUP_ROWS = 16 * RTO, BLOCK_ROWS = WR * GROUP_ROWS;
  for (int idx = threadIdx.x; idx < BLOCK_ROWS * M; idx += THREADS) {
    const int rb = idx % BLOCK_ROWS, m = idx / BLOCK_ROWS;
    const int grp = rb / GROUP_ROWS, rl = rb % GROUP_ROWS;
    const float rs = row_scale(m);
    float v = 0.0f, v_up = 0.0f;  // v_up: the up projection's sum beside the gate's (GATED)
    #pragma unroll
    for (int ww = 0; ww < WK; ++ww) {
      v += red[grp * WK + ww][rl][m];
      if constexpr (GATED) v_up += red[grp * WK + ww][rl + GROUP_ROWS][m];
    }
    const int row = block_base + rb;
    if (row < N) store(rb, m, row, output(v * rs, v_up * rs, (size_t)m * N + row));
  }
  // AFTER STORES
"""


def matrix_choice(count: int, weights: bool = True, outputs: bool = True, offsets: bool = False) -> list[str]:
    """The source lines that set a block's matrix among `count` (blocks matrix after matrix, matrix i's from block
    BLK{i}): its weight pointers (`weights`), output (`outputs`), row count N, first row among all the matrices'
    rows (`offsets`: off) and its block within the matrix (blk, which the caller declares with the others)."""
    lines, offset = [], "0"
    for i in range(count):
        test = "" if i == count - 1 else f"if (blk < BLK{i + 1}) "
        sets = f"w = w{i}; scales = scales{i}; biases = biases{i}; " * weights + f"out = out{i}; " * outputs
        sets += f"N = N{i}; " + f"off = {offset}; " * offsets + f"blk -= BLK{i};"
        lines.append(f"  {'else ' if i else ''}{test}{{ {sets} }}")
        offset += f" + N{i}"
    return lines


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
    lines = [
        "  constexpr bool GATED = false;",
        "  constexpr int RTO = RT;",
        "  const uint32_t* w; const __nv_bfloat16* scales; const __nv_bfloat16* biases; __nv_bfloat16* out;",
        "  int N, blk = blockIdx.x;",
    ]
    lines += matrix_choice(count)
    lines += [
        "  auto tile_w = [&](const int) { return w; };",
        "  auto tile_scales = [&](const int) { return scales; };",
        "  auto tile_biases = [&](const int) { return biases; };",
    ]
    return "\n".join(lines) + "\n"


def launch_bounds(threads: int, min_blocks: int) -> str:
    """Header lines that give the kernel MLX generates `__launch_bounds__(threads, min_blocks)`: MLX writes
    the signature itself, so `__global__` is redefined (as CUDA's headers define it, plus the bounds) for
    the rest of the source, which holds only this kernel."""
    if not min_blocks:
        return ""
    return f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n"


def kernel_source(count: int, fusion: Fusion = Fusion()) -> str:
    """The kernel's body: which of its `count` matrices a block takes, the fused stages, the loads, the
    products, the sum over warps."""
    start = _BODY_START.replace("  // FUSED STAGES\n", fusion.source())
    reduce = _REDUCE.replace("  // ROW SCALE\n", fusion.row_scale_source())
    reduce = reduce.replace("  // AFTER STORES\n", fusion.after_stores_source())
    return _prologue(count, fusion.gated) + start + _LOAD_REGISTERS + _MULTIPLY + _LOOP_REGISTERS + reduce


def output_names(count: int, fusion: Fusion = Fusion()) -> list[str]:
    """The kernel's outputs: one a matrix (one in all for a gated launch), then norm_out's two."""
    return [f"out{i}" for i in range(1 if fusion.gated else count)] + ["hw", "ssq_out"] * fusion.norm_out


def input_names(count: int, fusion: Fusion = Fusion()) -> list[str]:
    """The kernel's inputs, in the order `calls.launch_arguments` passes them."""
    return ["x"] + [f"{name}{i}" for i in range(count) for name in ("w", "scales", "biases")] + fusion.inputs()


@cache
def kernel(count: int, threads: int = 0, min_blocks: int = 0, fusion: Fusion = Fusion()):
    """The kernel for `count` matrices and these stages (`threads`, `min_blocks`: its launch bounds)."""
    return cuda_kernel(
        name=f"engine_affine_qmm{count}{fusion.tag()}",
        input_names=input_names(count, fusion),
        output_names=output_names(count, fusion),
        source=kernel_source(count, fusion),
        header=HEADER + launch_bounds(threads, min_blocks),
    )
