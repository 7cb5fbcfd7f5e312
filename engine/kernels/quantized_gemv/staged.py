"""The quantized matmul for 2 to 64 activation rows: activations staged in shared memory, K split over blocks.

At many rows the register kernel (`source`) reloads every activation row for
every warp's k-tile: a 64-row launch moves twice as many activation bytes as
weight bytes and waits on them. Here a block of W warps copies each chunk
(CK k-tiles) of all M activation rows and of its weight rows, scales and
biases into shared memory with `cp.async`, ST chunks at once; every warp then
multiplies its RT row tiles against all M rows from shared memory (the same
exact-integer weights, `mma.sync` and float32 group sums as the register
kernel, so the same error bound). Matrices with
large K split it over S blocks (`splits`): each writes float32 partial sums
and a second launch adds them in split order and runs the fused stages.
Where the blocks' rows end and which split adds which k-tiles depend on K and
the config only, so a matrix's result is the same in a launch of its own as
in one shared with others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

import mlx.core as mx

from engine.kernels.cuda_source import cuda_kernel
from engine.kernels.quantized_gemv.fusion import Fusion
from engine.kernels.quantized_gemv.launch import tile_k
from engine.kernels.quantized_gemv.layouts import NO_LAYOUTS, StagedLayouts
from engine.kernels.quantized_gemv.source import HEADER, input_names, launch_bounds, matrix_choice, output_names

MIN_ROWS = 2  # from here the staged kernel takes a launch; the register kernel below (one row)
SUM_ROWS = 64  # output rows a block of the split sums' launch takes (its blocks: the next launch's norm parts)
SUM_THREADS = 16  # threads a row there, each taking every SUM_THREADS-th activation row


@dataclass(frozen=True)
class StagedConfig:
    """How a staged launch is laid out: a block's warps, each warp's 16-row tiles, k-tiles a chunk (0: two
    groups' worth, at least two k-tiles), chunks in shared memory at once, blocks a row block's K is split
    over, blocks an SM must hold (0: as the registers allow), warps that share each row tile's activation
    blocks (`m_groups`: fewer sums a warp, more warps an SM), and how the weights enter the products
    (`rounded` 1: each weight rounded once to bf16, round(q * scale + bias), into one float32 sum a row; 0:
    exact integers with float32 group sums, the register kernel's arithmetic), and the row blocks a block takes
    in turn (`row_blocks`, split launches only: its split's activation rows copied once and kept in shared memory
    for all of them, so fewer blocks read them from L2)."""

    warps: int = 4
    row_tiles: int = 2
    chunk_tiles: int = 0
    stages: int = 2
    splits: int = 1
    min_blocks: int = 0
    m_groups: int = 1
    rounded: int = 0
    row_blocks: int = 1

    def chunk(self, group_size: int, bits: int) -> int:
        """k-tiles a chunk: a chunk's scales are copied 4 bytes (two groups) at a time."""
        tk = tile_k(group_size, bits)
        return self.chunk_tiles or max(2, 2 * group_size // tk)

    def template(self, group_size: int, bits: int) -> list[tuple[str, int]]:
        return [
            ("W", self.warps),
            ("RT", self.row_tiles),
            ("CK", self.chunk(group_size, bits)),
            ("ST", self.stages),
            ("S", self.splits),
            ("MG", self.m_groups),
            ("RW", self.rounded),
            ("NR", self.row_blocks),
        ] + ([("MINB", self.min_blocks)] if self.min_blocks else [])

    def threads(self) -> int:
        return self.warps * self.m_groups * 32

    def shared_bytes(self, m: int, group_size: int, bits: int, k: int = 0) -> int:
        """Dynamic shared memory of a products' launch: `stages` chunks of the activation rows and the block's
        weight rows, scales and biases (as the kernel's STAGE_BYTES); with row blocks in turn, every chunk of a
        split of K's activation rows (K = `k`) and `stages` of the rest."""
        tk = tile_k(group_size, bits)
        wide = tk == 8 * (32 // bits)  # two words a lane a row (WL = 2)
        kc = self.chunk(group_size, bits) * tk
        rows = self.warps * self.row_tiles * 16
        x_chunk = 8 * -(-m // 8) * (kc + (8 if wide else 32)) * 2
        rest = rows * (kc * bits // 32 + (8 if wide else 4)) * 4 + 4 * rows * (kc // group_size)
        if self.row_blocks > 1:
            return k // self.splits // kc * x_chunk + self.stages * rest
        return self.stages * (x_chunk + rest)


# The most k values one split adds: a longer K is split over blocks. The model's launches are dependent, so a
# launch whose grid fills the SMs a fraction of a wave leaves them idle: qwen27b's decode step at 16 / 32 / 64
# rows took 14.0 / 20.2 / 33.8 ms split at 2176 against 17.0 / 23.9 / 36.4 with only K > 5120 split at 4352
# (docs/kernels.md, "Batched rows").
SPLIT_K_VALUES = 2176


def splits(k: int, chunk: int, values: int = 0) -> int:
    """Blocks a row block's K is split over: the fewest that divide its chunks evenly into at most `values` (0:
    SPLIT_K_VALUES) values each (1 up to that many)."""
    chunks, values = k // chunk, values or SPLIT_K_VALUES
    return next((s for s in range(1, chunks + 1) if chunks % s == 0 and k // s <= values), chunks)


WIDE_ROWS = 33  # from here a block's row tiles take half their activation blocks a warp (m groups)
# ... below this many: from 49 (the 64-row bucket) 4 warps take all their rows again, as up to 32, which fills the
# SMs' last waves (gate+up 2.75 waves, down 0.81; `tools.kernel_resources`): 0.91-0.93x the 64-row step (H100)
NARROW_AGAIN_ROWS = 49
# From a batch of this many rows the weights enter rounded (`rounded` 1): 9% faster steps at 32 and 64 rows on the
# H200, and the float32 model gate passed there (docs/kernels.md, "Batched rows"). Slower at 16 rows.
ROUNDED_ROWS = 32


def staged_config(
    m: int, k: int, group_size: int, bits: int, layouts: StagedLayouts = NO_LAYOUTS, batch: int | None = None
) -> StagedConfig:
    """The launch for M rows and K inputs (docs/kernels.md, "Batched rows"): 2 chunks in shared memory; 4 warps of
    2 row tiles up to 32 rows and from NARROW_AGAIN_ROWS, from WIDE_ROWS 2 such warps, each with 2 warps that share
    their activation blocks (m groups); K split by `splits`; the weights rounded from a batch of ROUNDED_ROWS rows
    (`batch`, default M: the batch's rows, not its tokens, so a window of W tokens a row computes what its batch's
    one-token steps do). The first of `layouts` that takes M rows changes it."""
    wide = WIDE_ROWS <= m < NARROW_AGAIN_ROWS
    config = StagedConfig(warps=2, stages=2, m_groups=2) if wide else StagedConfig(stages=2)
    config = replace(config, rounded=int((m if batch is None else batch) >= ROUNDED_ROWS))
    fields = layouts.fields(m)
    values = fields.pop("split_values", 0)
    config = replace(config, **fields)
    if "splits" in fields:
        return config
    return replace(config, splits=splits(k, config.chunk(group_size, bits) * tile_k(group_size, bits), values))


DEFAULT_SHARED = 48 << 10  # a block's shared memory, static and dynamic, unless its kernel asks for more


def shared_request(config: StagedConfig, m: int, fusion: Fusion, group_size: int, bits: int, k: int = 0) -> int:
    """The dynamic shared memory a products' launch asks MLX for: its stages, or at least DEFAULT_SHARED where
    those and the fused stages' static arrays (at most: the prenormed parts' 8 KB copy and row scales, norm_out's
    squares) pass DEFAULT_SHARED together, which only a kernel that asks for more than 48000 bytes is let
    have (MLX then raises its limit)."""
    dynamic = config.shared_bytes(m, group_size, bits, k)
    static = 0
    if config.splits == 1:
        out_rows = 16 * config.row_tiles // (2 if fusion.gated else 1) * config.warps
        static = fusion.prenormed * ((8 << 10) + 4 * m) + fusion.norm_out * 4 * out_rows * (m + 1)
    return dynamic if dynamic + static <= DEFAULT_SHARED else max(dynamic, DEFAULT_SHARED)


MAX_SHARED = 227 << 10  # the most shared memory a block of sm_90 takes


def in_turn(config: StagedConfig, m: int, k: int, group_size: int, bits: int) -> StagedConfig:
    """`config` with one row block a block (`row_blocks` 1) where the kernel cannot take several in turn: an
    unsplit K (its blocks store results, not parts), a thread's weight copies not a whole number of its warp's
    tiles apart (8 bits at the default warps), or a split's activation rows past a block's shared memory."""
    copies = config.chunk(group_size, bits) * tile_k(group_size, bits) * bits // 128  # 16-byte copies a row
    threads = config.threads()
    apart = threads % copies == 0 and (threads // copies) % (16 * config.row_tiles) == 0
    fits = config.shared_bytes(m, group_size, bits, k) <= MAX_SHARED
    return config if config.splits > 1 and apart and fits else replace(config, row_blocks=1)


def takes(m: int, k: int, group_size: int, bits: int, fusion: Fusion) -> bool:
    """Whether the staged kernel computes this launch: MIN_ROWS to 64 rows, K whole chunks, no norm_scale (its
    squares are gathered from activations the register kernel loads)."""
    chunk = StagedConfig().chunk(group_size, bits) * tile_k(group_size, bits)
    return MIN_ROWS <= m <= 64 and k % chunk == 0 and not fusion.norm_scale


_BODY = r"""
  constexpr int PW = 32 / BITS;                     // values per 32-bit word
  constexpr int HALF = PW / 2;
  constexpr int SPW = PW / 4;                       // mma steps (16 k values) per word
  constexpr int WL = GS * BITS / 128 < 2 ? GS * BITS / 128 : 2;  // words per lane per row in one k-tile
  constexpr int TILE_K = 4 * WL * PW;               // a k-tile: 4 lanes x WL words, inside one group
  constexpr int STEPS = WL * SPW;
  constexpr int XR = WL * PW / 2;                   // activation registers (bf16 pairs) per lane and tile
  constexpr int NB = (M + 7) / 8;                   // 8-column blocks of activation rows
  constexpr int WR = W;                             // the fused stages' row groups: every warp on its own rows
  constexpr int KC = CK * TILE_K;                   // k values of a chunk
  constexpr int GC = KC / GS;                       // quantization groups of a chunk (>= 2: 4-byte copies)
  constexpr int KS = K / S;                         // k values a split adds
  constexpr int CHUNKS = KS / KC;
  static_assert(KS % KC == 0 && GC >= 2, "a split takes whole chunks of whole groups");
  constexpr int NBW = (NB + MG - 1) / MG;           // activation blocks a warp takes (of its m group's)
  constexpr int THREADS = W * MG * 32;              // a block's threads: MG groups of W warps
  constexpr int R = W * RT * 16;                    // weight rows of a block (a gated block's gate and up rows)
  // Shared rows, padded so that each load phase's lanes hit distinct banks: activations (bf16) and weights (words)
  constexpr int XS = KC + (WL == 2 ? 8 : 32);
  constexpr int WS = KC / PW + (WL == 2 ? 8 : 4);
  // NR > 1 (split launches): the block takes NR row blocks in turn, its split's activation rows copied once and
  // kept (CHUNKS chunks, then ST stages of weights, scales and biases); else ST stages of all three.
  constexpr bool RESIDENT = NR > 1;
  static_assert(!RESIDENT || S > 1, "row blocks in turn store split parts");
  constexpr int X_BYTES = 8 * NB * XS * 2;          // a chunk's activation rows
  constexpr int X_AREA = RESIDENT ? CHUNKS * X_BYTES : 0;
  constexpr int STAGE_BYTES = (RESIDENT ? 0 : X_BYTES) + R * WS * 4 + 2 * R * GC * 2;
  constexpr int BR = W * 16 * RTO;                  // output rows of a row block
  constexpr int WORDS_PER_ROW = K / PW;
  constexpr int GROUPS_PER_ROW = K / GS;
  using Words = typename engine_words<WL>::type;

  const int warp = (threadIdx.x >> 5) % W;          // the warp's rows: the same in every m group
  const int mg = MG == 1 ? 0 : (threadIdx.x >> 5) / W;  // its activation blocks: mg * NBW, ...
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int split = blockIdx.x % S;
  int block_base = blk * NR * BR;                   // the row block's first output row
  int row_base = block_base + warp * 16 * RTO;
  auto tile_row = [&](const int r) { return row_base + (r % RTO) * 16; };
  const uint32_t ones = 0x3F803F80u;                // bf16 (1, 1)
  const size_t k_first = (size_t)split * KS;
  // FUSED STAGES

  // ST stages of chunks in dynamic shared memory, each: the M activation rows, then the block's R weight rows
  // (row slot (warp * RT + r) * 16 + i: row i of the warp's tile r), then their scales and biases.
  extern __shared__ __align__(16) unsigned char engine_stages[];
  auto stage_x = [&](const int b) {  // RESIDENT: chunk b's activations, else stage b's
    return reinterpret_cast<__nv_bfloat16*>(engine_stages + b * (RESIDENT ? X_BYTES : STAGE_BYTES));
  };
  auto stage_w = [&](const int b) {
    return reinterpret_cast<uint32_t*>(engine_stages + X_AREA + b * STAGE_BYTES + (RESIDENT ? 0 : X_BYTES));
  };
  auto stage_s = [&](const int b) { return reinterpret_cast<__nv_bfloat16*>(stage_w(b) + R * WS); };
  // Each thread's copies of a chunk, planned once (a chunk moves every source by its k offset, never its rows):
  // its activation rows m0 + j * XM, its weight and scale rows' sources and slots. Rows past M or N are never
  // read into a stored result (an mma's B column reaches only its own output column): past N, N - 1's or none.
  constexpr int XV = KC / 8;                        // 16-byte copies an activation row
  constexpr int WV = KC / PW / 4;                   // 16-byte copies a weight row
  constexpr int NXC = (M * XV + THREADS - 1) / THREADS;
  constexpr int NWC = (R * WV + THREADS - 1) / THREADS;
  constexpr int SC = 2 * R * (GC / 2);              // 4-byte copies: two groups' scales (or biases)
  constexpr int NSC = (SC + THREADS - 1) / THREADS;
  constexpr bool X_ROWS = THREADS % XV == 0;        // a thread's activation copies keep one column
  constexpr int XM = X_ROWS ? THREADS / XV : 0;     // rows between them
  auto weight_row = [&](const int slot) {  // a weight slot's row of the matrix (past N where the block ends)
    const int r = (slot / 16) % RT;
    return block_base + (slot / (16 * RT)) * 16 * RTO + (r % RTO) * 16 + slot % 16;
  };
  const __nv_bfloat16* x_src = x + k_first + (X_ROWS ? (size_t)(threadIdx.x / XV) * K + (threadIdx.x % XV) * 8 : 0);
  const int x_dst = X_ROWS ? (threadIdx.x / XV) * XS + (threadIdx.x % XV) * 8 : 0;
  // Weight copies: a thread's slots lie SW apart; where that is a whole number of its warp's tiles (the default
  // layouts at 4 bits) they keep one matrix and rows a fixed stride apart, so one source and a check against N
  // do (a row past N is not copied), else each copy's source is kept.
  constexpr int SW = THREADS / WV;
  constexpr bool W_ROWS = THREADS % WV == 0 && SW % (16 * RT) == 0;
  constexpr int NWS = W_ROWS ? 1 : NWC;            // sources kept
  constexpr int W_STEP = W_ROWS ? SW / (16 * RT) * 16 * RTO : 0;  // rows between a thread's weight copies
  const uint32_t* w_src[NWS];
  int w_dst[NWS];
  int w_row = 0;
  #pragma unroll
  for (int j = 0; j < NWS; ++j) {
    const int i = threadIdx.x + j * THREADS, slot = min(i, R * WV - 1) / WV, v = i % WV;
    const int row = weight_row(slot);
    if (W_ROWS) w_row = row;
    w_src[j] = tile_w((slot / 16) % RT) + (size_t)min(row, N - 1) * WORDS_PER_ROW + k_first / PW + v * 4;
    w_dst[j] = slot * WS + v * 4;
  }
  const __nv_bfloat16* s_src[NSC];
  int s_dst[NSC], s_row[NSC];
  #pragma unroll
  for (int j = 0; j < NSC; ++j) {
    const int i = min(threadIdx.x + j * THREADS, SC - 1);
    const int which = i / (R * (GC / 2)), jj = i % (R * (GC / 2));
    const int slot = jj / (GC / 2), v = jj % (GC / 2), r = (slot / 16) % RT;
    s_row[j] = weight_row(slot);
    const size_t at = (size_t)min(s_row[j], N - 1) * GROUPS_PER_ROW + k_first / GS + 2 * v;
    s_src[j] = (which ? tile_biases(r) : tile_scales(r)) + at;
    s_dst[j] = which * R * GC + slot * GC + 2 * v;
  }
  // Iteration it's copies (chunk c of row block rb) into stage it % ST, committed as one group (empty past the
  // last); RESIDENT: the activations with the first row block's, into their own place.
  static_assert(!RESIDENT || W_ROWS, "row blocks in turn move one source a thread");
  constexpr int ITERS = NR * CHUNKS;
  auto issue = [&](const int it) {
    if (it < ITERS) {
      const int b = it % ST, c = RESIDENT ? it % CHUNKS : it, rb = RESIDENT ? it / CHUNKS : 0;
      __nv_bfloat16* sx = stage_x(RESIDENT ? c : b);
      if (!RESIDENT || rb == 0) {
        if constexpr (X_ROWS) {
          #pragma unroll
          for (int j = 0; j < NXC; ++j)
            if ((M * XV) % THREADS == 0 || (int)(threadIdx.x / XV) + j * XM < M)
              engine_cp16(sx + x_dst + j * XM * XS, x_src + (size_t)j * XM * K + c * KC);
        } else {
          #pragma unroll 1
          for (int i = threadIdx.x; i < M * XV; i += THREADS) {
            const int m = i / XV, v = i % XV;
            engine_cp16(sx + m * XS + v * 8, x_src + (size_t)m * K + c * KC + v * 8);
          }
        }
      }
      uint32_t* sw = stage_w(b);
      #pragma unroll
      for (int j = 0; j < NWC; ++j) {
        if constexpr (W_ROWS) {
          if (((R * WV) % THREADS == 0 || threadIdx.x + j * THREADS < R * WV) && w_row + rb * BR + j * W_STEP < N)
            engine_cp16(sw + w_dst[0] + j * SW * WS,
                   w_src[0] + (size_t)(rb * BR + j * W_STEP) * WORDS_PER_ROW + c * (KC / PW));
        } else if ((R * WV) % THREADS == 0 || threadIdx.x + j * THREADS < R * WV) {
          engine_cp16(sw + w_dst[j], w_src[j] + c * (KC / PW));
        }
      }
      __nv_bfloat16* ss = stage_s(b);
      #pragma unroll
      for (int j = 0; j < NSC; ++j)
        if ((SC % THREADS == 0 || threadIdx.x + j * THREADS < SC) && (!RESIDENT || s_row[j] + rb * BR < N))
          engine_cp4(ss + s_dst[j], s_src[j] + (size_t)rb * BR * GROUPS_PER_ROW + c * GC);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  float acc[RT][NBW][4];
  #pragma unroll
  for (int r = 0; r < RT; ++r)
    #pragma unroll
    for (int nb = 0; nb < NBW; ++nb)
      #pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][nb][i] = 0.0f;

  // Block nb's activations of k-tile u as the mma's B fragments: lane t's k values (its own WL words' worth)
  // feed its four B slots of each step in the order the weights' pairs come (a dot product's k order is free).
  auto fragments = [&](uint32_t (&xb)[STEPS][2], const __nv_bfloat16* sx, const int nb, const int u) {
    const __nv_bfloat16* src = sx + (g + 8 * nb) * XS + u * TILE_K + t * WL * PW;
    uint32_t xr[XR];
    #pragma unroll
    for (int j = 0; j < XR / 4; ++j) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + 8 * j);
      xr[4 * j] = v.x; xr[4 * j + 1] = v.y; xr[4 * j + 2] = v.z; xr[4 * j + 3] = v.w;
    }
    #pragma unroll
    for (int wi = 0; wi < WL; ++wi)
      #pragma unroll
      for (int h = 0; h < SPW; ++h) {
        const int a = wi * PW / 2 + h;
        xb[wi * SPW + h][0] = __byte_perm(xr[a], xr[a + HALF / 2], 0x5410);  // x[2h], x[2h + HALF]
        xb[wi * SPW + h][1] = __byte_perm(xr[a], xr[a + HALF / 2], 0x7632);  // x[2h + 1], x[2h + 1 + HALF]
      }
  };
  // Row tile r's A fragments of k-tile u (lane (g, t): its words of rows g and g + 8), each pair of values as
  // `pair(word, j, row)` makes it (row 0: g, 1: g + 8).
  auto weight_fragments = [&](uint32_t (&wa)[STEPS][4], const uint32_t* sw, const int r, const int u, auto pair) {
    const int slot = (warp * RT + r) * 16 + g;
    const Words q0 = *reinterpret_cast<const Words*>(sw + slot * WS + u * 4 * WL + t * WL);
    const Words q1 = *reinterpret_cast<const Words*>(sw + (slot + 8) * WS + u * 4 * WL + t * WL);
    const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&q0);
    const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&q1);
    #pragma unroll
    for (int wi = 0; wi < WL; ++wi)
      #pragma unroll
      for (int h = 0; h < SPW; ++h) {
        wa[wi * SPW + h][0] = pair(w0[wi], 2 * h, 0);
        wa[wi * SPW + h][1] = pair(w1[wi], 2 * h, 1);
        wa[wi * SPW + h][2] = pair(w0[wi], 2 * h + 1, 0);
        wa[wi * SPW + h][3] = pair(w1[wi], 2 * h + 1, 1);
      }
  };
  // RW = 0, k-tile u of a stage: the warp's row tiles as exact integers (engine_pair), then each 8-row block of
  // activations as B fragments, its sums (the bias term) and its products with every row tile, each row tile's
  // group sums scaled in float32.
  auto exact_tile = [&](const __nv_bfloat16* sx, const uint32_t* sw, const __nv_bfloat16* ss, const int u) {
    uint32_t wa[RT][STEPS][4];
    float s0[RT], s1[RT], b0[RT], b1[RT];
    #pragma unroll
    for (int r = 0; r < RT; ++r) {
      const int slot = (warp * RT + r) * 16 + g;
      weight_fragments(wa[r], sw, r, u, [](const uint32_t w, const int j, const int) { return engine_pair<BITS>(w, j); });
      constexpr float o = engine_offset<BITS>::value;
      const int grp = u * TILE_K / GS;
      s0[r] = __bfloat162float(ss[slot * GC + grp]);
      s1[r] = __bfloat162float(ss[(slot + 8) * GC + grp]);
      b0[r] = fmaf(-o, s0[r], __bfloat162float(ss[R * GC + slot * GC + grp]));
      b1[r] = fmaf(-o, s1[r], __bfloat162float(ss[R * GC + (slot + 8) * GC + grp]));
    }
    #pragma unroll
    for (int nbl = 0; nbl < NBW; ++nbl) {
      const int nb = mg * NBW + nbl;
      if (NB % MG && nb >= NB) break;
      uint32_t xb[STEPS][2];
      fragments(xb, sx, nb, u);
      float xsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the block's sums over the tile (the bias term)
      #pragma unroll
      for (int st = 0; st < STEPS; ++st) engine_mma(xsum, ones, ones, ones, ones, xb[st][0], xb[st][1]);
      #pragma unroll
      for (int r = 0; r < RT; ++r) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        #pragma unroll
        for (int st = 0; st < STEPS; ++st) engine_mma(d, wa[r][st][0], wa[r][st][1], wa[r][st][2], wa[r][st][3], xb[st][0], xb[st][1]);
        acc[r][nbl][0] = fmaf(s0[r], d[0], fmaf(b0[r], xsum[0], acc[r][nbl][0]));
        acc[r][nbl][1] = fmaf(s0[r], d[1], fmaf(b0[r], xsum[1], acc[r][nbl][1]));
        acc[r][nbl][2] = fmaf(s1[r], d[2], fmaf(b1[r], xsum[2], acc[r][nbl][2]));
        acc[r][nbl][3] = fmaf(s1[r], d[3], fmaf(b1[r], xsum[3], acc[r][nbl][3]));
      }
    }
  };
  // RW = 1: the k-tile's weights as bf16 round(q * scale + bias), one rounding (engine_dequant), so every product
  // adds into its row's one float32 sum: no group sums to scale, no bias term.
  auto rounded_tile = [&](const __nv_bfloat16* sx, const uint32_t* sw, const __nv_bfloat16* ss, const int u) {
    uint32_t wa[RT][STEPS][4];
    const int grp = u * TILE_K / GS;
    #pragma unroll
    for (int r = 0; r < RT; ++r) {
      const int slot = (warp * RT + r) * 16 + g;
      const __nv_bfloat162 s0 = __bfloat162bfloat162(ss[slot * GC + grp]);
      const __nv_bfloat162 s1 = __bfloat162bfloat162(ss[(slot + 8) * GC + grp]);
      const __nv_bfloat162 b0 = __bfloat162bfloat162(ss[R * GC + slot * GC + grp]);
      const __nv_bfloat162 b1 = __bfloat162bfloat162(ss[R * GC + (slot + 8) * GC + grp]);
      weight_fragments(wa[r], sw, r, u, [&](const uint32_t w, const int j, const int row) {
        return engine_dequant<BITS>(w, j, row ? s1 : s0, row ? b1 : b0);
      });
    }
    #pragma unroll
    for (int nbl = 0; nbl < NBW; ++nbl) {
      const int nb = mg * NBW + nbl;
      if (NB % MG && nb >= NB) break;
      uint32_t xb[STEPS][2];
      fragments(xb, sx, nb, u);
      #pragma unroll
      for (int st = 0; st < STEPS; ++st)
        #pragma unroll
        for (int r = 0; r < RT; ++r)
          engine_mma(acc[r][nbl], wa[r][st][0], wa[r][st][1], wa[r][st][2], wa[r][st][3], xb[st][0], xb[st][1]);
    }
  };
  auto multiply = [&](const int it) {
    const int b = it % ST;
    const __nv_bfloat16* sx = stage_x(RESIDENT ? it % CHUNKS : b);
    #pragma unroll
    for (int u = 0; u < CK; ++u) {
      if constexpr (RW != 0) rounded_tile(sx, stage_w(b), stage_s(b), u);
      else exact_tile(sx, stage_w(b), stage_s(b), u);
    }
  };

  // ST - 1 iterations in flight: at iteration it, wait for its copies, then (one barrier: every warp is done with
  // iteration it - 1's stage) issue iteration it + ST - 1's into that stage, then multiply. RESIDENT: after each
  // row block but the last, its parts are stored and the sums start over on the next.
  #pragma unroll
  for (int it = 0; it < ST - 1; ++it) issue(it);
  #pragma unroll 1
  for (int it = 0; it < ITERS; ++it) {
    asm volatile("cp.async.wait_group %0;" :: "n"(ST - 2) : "memory");
    __syncthreads();
    issue(it + ST - 1);
    multiply(it);
    if (RESIDENT && it % CHUNKS == CHUNKS - 1 && it + 1 < ITERS) {
      // ROW BLOCK DONE
      block_base += BR;
      row_base += BR;
      #pragma unroll
      for (int r = 0; r < RT; ++r)
        #pragma unroll
        for (int nb = 0; nb < NBW; ++nb)
          #pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][nb][i] = 0.0f;
    }
  }
"""

# S = 1: the sums are the results; the fused stages store them (accumulator i of lane (g, t): row g + 8 * (i / 2),
# activation row 2t + i % 2 of its block).
_STORE = r"""
  // ROW SCALE
  __syncthreads();
  #pragma unroll
  for (int r = 0; r < RTO; ++r)
    #pragma unroll
    for (int nbl = 0; nbl < NBW; ++nbl)
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = (mg * NBW + nbl) * 8 + 2 * t + (i & 1);
        const int rb = warp * 16 * RTO + r * 16 + g + 8 * (i >> 1);
        const int row = block_base + rb;
        if (m < M && row < N) {
          const float rs = row_scale(m);
          store(rb, m, row, output(acc[r][nbl][i] * rs, acc[GATED ? r + RTO : r][nbl][i] * rs, (size_t)m * N + row));
        }
      }
  // AFTER STORES
"""

# S > 1: each split's float32 sums into part [S, M, NT], matrix after matrix (a gated launch's up rows after its
# gate rows).
_PARTIAL_STORE = r"""
  #pragma unroll
  for (int r = 0; r < RT; ++r)
    #pragma unroll
    for (int nbl = 0; nbl < NBW; ++nbl)
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = (mg * NBW + nbl) * 8 + 2 * t + (i & 1);
        const int row = tile_row(r) + g + 8 * (i >> 1);
        if (m < M && row < N) part[((size_t)split * M + m) * NT + tile_off(r) + row] = acc[r][nbl][i];
      }
"""

# The split sums' launch: SUM_THREADS threads a row of SUM_ROWS a block, each activation row's S parts added in
# split order (MT rows' loads in flight at once), then the fused stages as the S = 1 store runs them.
_SUM = r"""
  constexpr int W = SUM_W, WR = 1, RTO = SUM_ROWS / 16;  // the fused stages' names for the block's rows
  constexpr int NB = (M + 7) / 8, THREADS = SUM_ROWS * SUM_THREADS;
  constexpr int MT = 4;                                  // activation rows a thread adds at once
  // FUSED STAGES
  // ROW SCALE
  __syncthreads();
  const int rb = threadIdx.x % SUM_ROWS, row = blk * SUM_ROWS + rb;
  for (int m0 = threadIdx.x / SUM_ROWS; m0 < M; m0 += SUM_THREADS * MT) {
    float v[MT], v_up[MT];
    #pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int m = m0 + j * SUM_THREADS;
      v[j] = 0.0f;
      v_up[j] = 0.0f;
      if (m < M && row < N)
        #pragma unroll
        for (int s = 0; s < S; ++s) {
          const float* p = part + ((size_t)s * M + m) * NT + off + row;
          v[j] += p[0];
          if constexpr (GATED) v_up[j] += p[N];
        }
    }
    #pragma unroll
    for (int j = 0; j < MT; ++j) {
      const int m = m0 + j * SUM_THREADS;
      if (m < M && row < N) {
        const float rs = row_scale(m);
        store(rb, m, row, output(v[j] * rs, v_up[j] * rs, (size_t)m * N + row));
      }
    }
  }
  // AFTER STORES
"""


# What a row tile r reads: its matrix's weights, scales and biases, and where its rows start in the parts
# (a gated launch's gate and up values; a plain launch's block's matrix)
_TILES = (("w", "w0", "w1"), ("scales", "scales0", "scales1"), ("biases", "biases0", "biases1"), ("off", "0", "N0"))


def _prologue(count: int, gated: bool, main: bool, outputs: bool = True) -> str:
    """Which of the `count` matrices a block takes (blocks matrix after matrix, matrix i's from BLK{i}) and
    where its rows start in the parts (`off`; `tile_off(r)` for row tile r: a gated launch's up tiles after
    the gate's N0 rows). `main`: the products' launch (weight pointers, splits S blocks a row block), else the
    sums' launch; `outputs`: the launch writes the results (not the parts)."""
    blk = "blockIdx.x / S" if main else "blockIdx.x"
    if gated:
        lines = [
            "  constexpr bool GATED = true;",
            "  constexpr int RTO = RT / 2;" * main,
            f"  const int N = N0, blk = {blk}, off = 0;",
            "  __nv_bfloat16* out = out0;" * outputs,
        ]
        if main:  # tiles below RTO from the gate, the rest from up
            lines += [
                f"  auto tile_{name} = [&](const int r) {{ return r < RTO ? {gate} : {up}; }};"
                for name, gate, up in _TILES
            ]
        return "\n".join(line for line in lines if line) + "\n"
    lines = [
        "  constexpr bool GATED = false;",
        "  constexpr int RTO = RT;" * main,
        "  const uint32_t* w; const __nv_bfloat16* scales; const __nv_bfloat16* biases;" * main,
        "  __nv_bfloat16* out;" * outputs,
        f"  int N, off, blk = {blk};",
    ]
    lines += matrix_choice(count, weights=main, outputs=outputs, offsets=True)
    if main:
        lines += [f"  auto tile_{name} = [&](const int) {{ return {name}; }};" for name, _, _ in _TILES]
    return "\n".join(line for line in lines if line) + "\n"


def _with_stages(body: str, fusion: Fusion | None) -> str:
    """`body` with the fused stages in their marked places (None: no stages, the parts' launch)."""
    marks = {
        "  // FUSED STAGES\n": "source",
        "  // ROW SCALE\n": "row_scale_source",
        "  // AFTER STORES\n": "after_stores_source",
    }
    for mark, stage in marks.items():
        body = body.replace(mark, getattr(fusion, stage)() if fusion else "")
    return body


ROW_BLOCK_DONE = "      // ROW BLOCK DONE\n"  # where a split launch stores a row block's parts before the next


def source(count: int, fusion: Fusion, split: bool) -> str:
    """The products' launch body: the results with their stages (`split` False), or each split's partial sums
    (True; the sums' launch runs the stages)."""
    if split:
        body = _BODY.replace(ROW_BLOCK_DONE, _PARTIAL_STORE)
        return _prologue(count, fusion.gated, True, outputs=False) + _with_stages(body + _PARTIAL_STORE, None)
    return _prologue(count, fusion.gated, True) + _with_stages(_BODY.replace(ROW_BLOCK_DONE, "") + _STORE, fusion)


def sum_source(count: int, fusion: Fusion) -> str:
    """The split sums' launch body."""
    body = _SUM.replace("SUM_ROWS", str(SUM_ROWS)).replace("SUM_THREADS", str(SUM_THREADS))
    body = body.replace("SUM_W", str(SUM_ROWS * SUM_THREADS // 32))
    return _prologue(count, fusion.gated, False) + _with_stages(body, fusion)


@cache
def kernel(count: int, fusion: Fusion, split: bool, shared: int, threads: int = 0, min_blocks: int = 0):
    """The products' launch kernel with `shared` bytes of dynamic shared memory (`threads`, `min_blocks`: its
    launch bounds)."""
    outputs = ["part"] if split else output_names(count, fusion)
    inputs = input_names(count, Fusion() if split else fusion)
    tag = "_part" if split else fusion.tag()
    return cuda_kernel(
        name=f"engine_affine_sqmm{count}{tag}",
        input_names=inputs,
        output_names=outputs,
        source=source(count, fusion, split),
        header=HEADER + launch_bounds(threads, min_blocks),
        shared_memory=shared,
    )


@cache
def sum_kernel(count: int, fusion: Fusion):
    inputs = ["x", "part"] + fusion.inputs()
    return cuda_kernel(
        name=f"engine_affine_sqmm_sum{count}{fusion.tag()}",
        input_names=inputs,
        output_names=output_names(count, fusion),
        source=sum_source(count, fusion),
        header=HEADER,
    )


def matmuls(
    x: mx.array,
    matrices: Sequence[tuple[mx.array, mx.array, mx.array]],
    group_size: int,
    bits: int,
    config: StagedConfig,
    fusion: Fusion,
    extra: Sequence[mx.array],
    template: list,
) -> list[mx.array]:
    """The staged launch(es) of `calls.quantized_matmuls`: the same results in the same layout. `template`: the
    stages' own template values (P, EPS)."""
    k = x.shape[-1]
    m = x.size // k
    if fusion.gated:  # a warp's tiles in pairs: a gate tile and the up tile of the same rows
        config = replace(config, row_tiles=config.row_tiles + config.row_tiles % 2)
    config = in_turn(config, m, k, group_size, bits)
    rows = [w.shape[0] for w, _, _ in matrices]
    count = len(matrices)
    products = 1 if fusion.gated else count
    tile_rows = 16 * config.row_tiles // (2 if fusion.gated else 1) * config.warps

    def starts(block_rows: int) -> list[int]:
        out = [0]
        for n in rows[:products]:
            out.append(out[-1] + -(-n // block_rows))
        return out

    main_blocks = starts(tile_rows * config.row_blocks)
    base = (
        [("K", k), ("M", m), ("BITS", bits), ("GS", group_size)]
        + config.template(group_size, bits)
        + [(f"N{i}", n) for i, n in enumerate(rows)]
        + [("NT", sum(rows))]
    )
    weights = [a for triple in matrices for a in triple]
    threads = config.threads()
    bounds = (shared_request(config, m, fusion, group_size, bits, k),) + (
        (threads, config.min_blocks) if config.min_blocks else (0, 0)
    )
    shapes = [(*x.shape[:-1], n) for n in rows[:products]]
    dtypes = [mx.bfloat16] * products
    if config.splits == 1:
        norm_out = fusion.norm_out * [(*x.shape[:-1], rows[0]), (m, main_blocks[-1])]
        return kernel(count, fusion, False, *bounds)(
            inputs=[x] + weights + list(extra),
            template=base + [(f"BLK{i}", b) for i, b in enumerate(main_blocks[:-1])] + template,
            grid=(main_blocks[-1] * threads, 1, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=shapes + norm_out,
            output_dtypes=dtypes + fusion.norm_out * [mx.bfloat16, mx.float32],
        )
    (part,) = kernel(count, fusion, True, *bounds)(
        inputs=[x] + weights,
        template=base + [(f"BLK{i}", b) for i, b in enumerate(main_blocks[:-1])],
        grid=(main_blocks[-1] * config.splits * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(config.splits, m, sum(rows))],
        output_dtypes=[mx.float32],
    )
    sum_blocks = starts(SUM_ROWS)
    norm_out = fusion.norm_out * [(*x.shape[:-1], rows[0]), (m, sum_blocks[-1])]
    return sum_kernel(count, fusion)(
        inputs=[x, part] + list(extra),
        template=[("K", k), ("M", m), ("S", config.splits), ("NT", sum(rows))]
        + [(f"N{i}", n) for i, n in enumerate(rows)]
        + [(f"BLK{i}", b) for i, b in enumerate(sum_blocks[:-1])]
        + template,
        grid=(sum_blocks[-1] * SUM_ROWS * SUM_THREADS, 1, 1),
        threadgroup=(SUM_ROWS * SUM_THREADS, 1, 1),
        output_shapes=shapes + norm_out,
        output_dtypes=dtypes + fusion.norm_out * [mx.bfloat16, mx.float32],
    )
