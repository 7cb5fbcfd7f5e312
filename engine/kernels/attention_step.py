"""A gated-attention layer's one-token attention as two CUDA kernels.

Between its q/k/v projections and its output projection, a Qwen3.5
full-attention layer does for one token: split q from the output gate, the
q and k RMS norms, rope on both at the cache's offset, the cache update,
attention over the cache, and the sigmoid gate. As MLX operations that is
~30 graph nodes a layer each step (reshapes, transposes, the norms, two
ropes of two launches each, the cache's slices, MLX's attention for head dim
256 at one query as unflatten, matmul, softmax, matmul, flatten, the gate),
and the host handles every one of them each step. Here it is:

- `keys`: one launch for the new token's k (norm and rope) and v, in the
  cache's [B, kv heads, 1, D] layout;
- the cache's own update (two slice updates, as the layer's path makes);
- `attend`: one launch for q's norm and rope, attention over the cache's
  positions and the output gate, written as o_proj's input (two for a long
  cache: chunks of the positions, then their merge).

Each batch row has its own positions (`row_params`): the cache columns it
holds, [start, n), and the rope position of its new token. A serial cache's
rows all start at 0; the continuous batcher's left-padded cache starts each
row after its padding, so a batch of any mix of lengths is one launch.

Numerics: the roundings of the layer's path are kept where it rounds to the
activation dtype (bf16) before a value is stored or reused: the normed q and
k, the roped q and k, the attention output, the sigmoid gate. The layer's
path also rounds q * scale, the scores and the probabilities to bf16; here
they stay float32 (online softmax over the cache in one pass), so the
result is the layer's to bf16 rounding of those, not bit for bit: the fast
tier.

One block per (batch row, q head), 8 warps: each warp walks positions
j = warp, warp + 8, ... with its lanes across the head dimension (D / 32
channels a lane, one 16-byte load a lane for D = 256), loading 4 positions
before folding them into a running max, sum and weighted values; the warps
are merged at the end. Past 512 positions the positions are split into
chunks (`splits`, up to 16), a block per (row, head, chunk), and a third
launch merges the chunks as the warps are merged: one block walking a 1K
cache would wait on ~32 loads in a row per warp (docs/kernels.md).
"""

from __future__ import annotations

import math
from functools import cache, lru_cache

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.cuda_source import cuda_kernel

WARPS = 8  # warps a block of `attend`
MAX_HEAD_DIM = WARPS * 32  # one thread per channel in the block-wide stages

HEADER = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ float engine_bf16r(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The sum of v over the block (all threads call it), to every thread; red holds a float a warp.
__device__ __forceinline__ float engine_block_sum(float v, float* red) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += red[w];
  __syncthreads();
  return total;
}

// Channel t of a head after rope (MLX's non-traditional form: channel i < R/2 pairs with i + R/2) at
// position pos; channels from R on pass unchanged. xs: the head's D channels.
template <int R>
__device__ __forceinline__ float engine_rope(const float* xs, int t, int pos, float log2_base, float scale) {
  constexpr int HALF = R / 2;
  if (t >= R) return xs[t];
  const int i = t < HALF ? t : t - HALF;
  const float inv_freq = exp2f(-((float)i / (float)HALF) * log2_base);
  const float theta = (scale * (float)pos) * inv_freq;
  const float c = cosf(theta), s = sinf(theta);
  const float x1 = xs[i], x2 = xs[i + HALF];
  return t < HALF ? x1 * c - x2 * s : x1 * s + x2 * c;
}

// The RMS norm of the block's D channels as MLX's RMSNorm rounds it: bf16(w * bf16(x * rsqrt(ms + eps))).
template <int D>
__device__ __forceinline__ float engine_head_norm(float x, const __nv_bfloat16* w, float eps, float* red) {
  const int t = threadIdx.x;
  const float ss = engine_block_sum(t < D ? x * x : 0.0f, red);
  return t < D ? engine_bf16r((float)w[t] * engine_bf16r(x * rsqrtf(ss / D + eps))) : 0.0f;
}

// E consecutive bf16 values as floats (16-byte loads where E allows).
template <int E>
__device__ __forceinline__ void engine_load_row(const __nv_bfloat16* p, float (&out)[E]) {
  if constexpr (E % 8 == 0) {
    #pragma unroll
    for (int c = 0; c < E / 8; ++c) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[c];
      const __nv_bfloat162* pair = reinterpret_cast<const __nv_bfloat162*>(&u);
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pair[i]);
        out[8 * c + 2 * i] = f.x;
        out[8 * c + 2 * i + 1] = f.y;
      }
    }
  } else {
    #pragma unroll
    for (int i = 0; i < E; ++i) out[i] = __bfloat162float(p[i]);
  }
}

// P positions j0, j0 + W, ... (those before end) of a kv head's keys and values, E channels a lane.
template <int P, int E, int W, int D>
__device__ __forceinline__ void engine_load_positions(const __nv_bfloat16* keys, const __nv_bfloat16* values,
                                                      size_t head, int j0, int end, float (&kr)[P][E],
                                                      float (&vr)[P][E]) {
  #pragma unroll
  for (int p = 0; p < P; ++p) {
    if (j0 + p * W < end) {
      engine_load_row<E>(keys + head + (size_t)(j0 + p * W) * D, kr[p]);
      engine_load_row<E>(values + head + (size_t)(j0 + p * W) * D, vr[p]);
    }
  }
}

// One position folded into a warp's running max m, sum l and weighted values acc: q's score against its key
// (qv and kr: a lane's E channels, summed over the warp), then its value.
template <int E>
__device__ __forceinline__ void engine_fold(const float (&qv)[E], const float (&kr)[E], const float (&vr)[E],
                                            float& m, float& l, float (&acc)[E]) {
  float s = 0.0f;
  #pragma unroll
  for (int e = 0; e < E; ++e) s += qv[e] * kr[e];
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float mn = fmaxf(m, s);
  const float corr = __expf(m - mn), pr = __expf(s - mn);
  l = l * corr + pr;
  #pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + pr * vr[e];
  m = mn;
}

// The W warps' running max, sum and weighted values (wm, wl, wacc) merged: the block's max, sum and channel t's
// weighted sum (t < D; a warp with no positions has m = -inf and adds nothing).
template <int W, int D>
__device__ __forceinline__ void engine_merge_warps(const float* wm, const float* wl, const float (*wacc)[D], int t,
                                                   float& top, float& total, float& o) {
  top = -INFINITY, total = 0.0f, o = 0.0f;
  if (t < D) {
    #pragma unroll
    for (int w = 0; w < W; ++w) top = fmaxf(top, wm[w]);
    #pragma unroll
    for (int w = 0; w < W; ++w) {
      const float f = wm[w] == -INFINITY ? 0.0f : __expf(wm[w] - top);
      total += wl[w] * f;
      o += wacc[w][t] * f;
    }
  }
}
"""

# ipar: [n, cap, chunk, splits] (the cache columns after this token's update, the buffer's length, the
# chunks); rpar: [B, 4], a row's first column and its new token's rope position; fpar: [eps, log2 base, rope
# scale, attention scale]
KEYS_SOURCE = r"""
  // Block (b, g): batch row b, kv head g; thread t: channel t.
  const int t = threadIdx.x, b = blockIdx.x / HKV;
  __shared__ float xs[D];
  __shared__ float red[D / 32];
  const size_t row = (size_t)blockIdx.x * D;  // [B, 1, HKV * D] in, [B, HKV, 1, D] out: the same offsets
  v_out[row + t] = v[row + t];
  xs[t] = engine_head_norm<D>((float)k[row + t], k_norm_w, fpar[0], red);
  __syncthreads();
  k_out[row + t] = __float2bfloat16(engine_rope<R>(xs, t, rpar[4 * b + 1], fpar[1], fpar[2]));
"""

# `attend`: the block's columns are chunk c of `splits` (chunk columns each, the last up to n), from the row's
# first column on
_ATTEND_BODY = r"""
  // Block (b, h, c): batch row b, q head h of kv head g, chunk c of the positions; WARPS warps; channels
  // split over lanes, E a lane.
  constexpr int E = D / 32;
  const int n = ipar[0], cap = ipar[1], chunk = ipar[2], splits = ipar[3];
  const int bh = blockIdx.x / splits, c = blockIdx.x % splits;
  const int b = bh / H, h = bh % H, g = h / (H / HKV);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  __shared__ float qs[D];
  __shared__ float red[WARPS], wm[WARPS], wl[WARPS];
  __shared__ float wacc[WARPS][D];

  // q (the first D of the head's 2 D projected channels; the gate is the second D): norm, rope, scale
  const size_t qrow = ((size_t)b * H + h) * 2 * D;
  const float qn = engine_head_norm<D>(t < D ? (float)q[qrow + t] : 0.0f, q_norm_w, fpar[0], red);
  if (t < D) qs[t] = qn;
  __syncthreads();
  const float qr = t < D ? engine_bf16r(engine_rope<R>(qs, t, rpar[4 * b + 1], fpar[1], fpar[2])) : 0.0f;
  __syncthreads();
  if (t < D) qs[t] = qr * fpar[3];
  __syncthreads();
  float qv[E];
  #pragma unroll
  for (int e = 0; e < E; ++e) qv[e] = qs[lane * E + e];

  // one pass over the chunk's positions with a running max m, sum l and weighted values acc: warp w takes
  // positions w, w + WARPS, ... in order, loading P of them before folding them in
  constexpr int P = 4;
  const int start = max(c * chunk, rpar[4 * b]), end = min(n, c * chunk + chunk);
  const size_t head = ((size_t)b * HKV + g) * (size_t)cap * D + lane * E;
  float m = -INFINITY, l = 0.0f, acc[E];
  #pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.0f;
  for (int j0 = start + warp; j0 < end; j0 += P * WARPS) {
    float kr[P][E], vr[P][E];
    engine_load_positions<P, E, WARPS, D>(keys, values, head, j0, end, kr, vr);
    #pragma unroll
    for (int p = 0; p < P; ++p)
      if (j0 + p * WARPS < end) engine_fold<E>(qv, kr[p], vr[p], m, l, acc);
  }
  if (lane == 0) { wm[warp] = m; wl[warp] = l; }
  #pragma unroll
  for (int e = 0; e < E; ++e) wacc[warp][lane * E + e] = acc[e];
  __syncthreads();
  float top, total, o;
  engine_merge_warps<WARPS, D>(wm, wl, wacc, t, top, total, o);
"""

# one chunk: the attention output rounded to bf16, then the sigmoid gate
_ATTEND_OUTPUT = r"""
  if (t < D) {
    const float gate = (float)q[qrow + D + t];
    const float sig = engine_bf16r(1.0f / (1.0f + __expf(-gate)));
    out[((size_t)b * H + h) * D + t] = __float2bfloat16(engine_bf16r(o / total) * sig);
  }
"""

# several: the chunk's max, sum and weighted values for `MERGE_SOURCE`
_ATTEND_PARTIAL = r"""
  if (t < D) part_acc[(size_t)blockIdx.x * D + t] = o;
  if (t == 0) { part_ml[2 * blockIdx.x] = top; part_ml[2 * blockIdx.x + 1] = total; }
"""

ATTEND_SOURCE = _ATTEND_BODY + _ATTEND_OUTPUT
PARTIAL_SOURCE = _ATTEND_BODY + _ATTEND_PARTIAL

# `attend` grouped: one block per (row, kv head, chunk) for all G = H / HKV q heads of the kv head, which read the
# same keys and values: each position's k and v come from L2 once for G heads instead of once a head. Each head's
# sums run as `_ATTEND_BODY`'s do (a warp's positions and their order, the same expressions), so a head's result
# is `attend`'s; P (positions loaded a batch) only batches the loads. The heads' output stages then run one head
# after another through the same shared memory, into `attend`'s output or partial layout.
_GROUP_BODY = r"""
  constexpr int E = D / 32;
  constexpr int G = H / HKV;
  const int n = ipar[0], cap = ipar[1], chunk = ipar[2], splits = ipar[3];
  const int bg = blockIdx.x / splits, c = blockIdx.x % splits;
  const int b = bg / HKV, g = bg % HKV;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  __shared__ float qs[D];
  __shared__ float qg[G][D];
  __shared__ float red[WARPS], wm[WARPS], wl[WARPS];
  __shared__ float wacc[WARPS][D];

  // each head's q: norm, rope, scale
  #pragma unroll 1
  for (int hl = 0; hl < G; ++hl) {
    const size_t qrow = ((size_t)b * H + g * G + hl) * 2 * D;
    const float qn = engine_head_norm<D>(t < D ? (float)q[qrow + t] : 0.0f, q_norm_w, fpar[0], red);
    if (t < D) qs[t] = qn;
    __syncthreads();
    const float qr = t < D ? engine_bf16r(engine_rope<R>(qs, t, rpar[4 * b + 1], fpar[1], fpar[2])) : 0.0f;
    __syncthreads();
    if (t < D) qg[hl][t] = qr * fpar[3];
  }
  __syncthreads();
  float qv[G][E];
  #pragma unroll
  for (int hl = 0; hl < G; ++hl)
    #pragma unroll
    for (int e = 0; e < E; ++e) qv[hl][e] = qg[hl][lane * E + e];

  constexpr int P = 2;
  const int start = max(c * chunk, rpar[4 * b]), end = min(n, c * chunk + chunk);
  const size_t head = ((size_t)b * HKV + g) * (size_t)cap * D + lane * E;
  float m[G], l[G], acc[G][E];
  #pragma unroll
  for (int hl = 0; hl < G; ++hl) {
    m[hl] = -INFINITY;
    l[hl] = 0.0f;
    #pragma unroll
    for (int e = 0; e < E; ++e) acc[hl][e] = 0.0f;
  }
  for (int j0 = start + warp; j0 < end; j0 += P * WARPS) {
    float kr[P][E], vr[P][E];
    engine_load_positions<P, E, WARPS, D>(keys, values, head, j0, end, kr, vr);
    #pragma unroll
    for (int p = 0; p < P; ++p)
      if (j0 + p * WARPS < end)
        #pragma unroll
        for (int hl = 0; hl < G; ++hl) engine_fold<E>(qv[hl], kr[p], vr[p], m[hl], l[hl], acc[hl]);
  }

  // head after head: merge the warps as `attend` does, then the head's output stage
  #pragma unroll
  for (int hl = 0; hl < G; ++hl) {
    if (lane == 0) { wm[warp] = m[hl]; wl[warp] = l[hl]; }
    #pragma unroll
    for (int e = 0; e < E; ++e) wacc[warp][lane * E + e] = acc[hl][e];
    __syncthreads();
    float top, total, o;
    engine_merge_warps<WARPS, D>(wm, wl, wacc, t, top, total, o);
    const int h = g * G + hl;
    const size_t bh = (size_t)b * H + h;
"""

# one chunk: as `_ATTEND_OUTPUT`
_GROUP_OUTPUT = r"""
    if (t < D) {
      const float gate = (float)q[bh * 2 * D + D + t];
      const float sig = engine_bf16r(1.0f / (1.0f + __expf(-gate)));
      out[bh * D + t] = __float2bfloat16(engine_bf16r(o / total) * sig);
    }
    __syncthreads();
  }
"""

# several: as `_ATTEND_PARTIAL`, at the index `attend`'s block (b, h, c) writes
_GROUP_PARTIAL = r"""
    const size_t part = bh * splits + c;
    if (t < D) part_acc[part * D + t] = o;
    if (t == 0) { part_ml[2 * part] = top; part_ml[2 * part + 1] = total; }
    __syncthreads();
  }
"""

GROUP_SOURCE = _GROUP_BODY + _GROUP_OUTPUT
GROUP_PARTIAL_SOURCE = _GROUP_BODY + _GROUP_PARTIAL

MERGE_SOURCE = r"""
  // Block (b, h): the chunks' partial results merged as the warps' are; thread t: channel t.
  const int splits = ipar[3];
  const int bh = blockIdx.x, t = threadIdx.x;
  float top = -INFINITY, total = 0.0f, o = 0.0f;
  for (int c = 0; c < splits; ++c) top = fmaxf(top, part_ml[2 * (bh * splits + c)]);
  for (int c = 0; c < splits; ++c) {
    const float mc = part_ml[2 * (bh * splits + c)];
    const float f = mc == -INFINITY ? 0.0f : __expf(mc - top);
    total += part_ml[2 * (bh * splits + c) + 1] * f;
    o += part_acc[(size_t)(bh * splits + c) * D + t] * f;
  }
  const float gate = (float)q[(size_t)bh * 2 * D + D + t];
  const float sig = engine_bf16r(1.0f / (1.0f + __expf(-gate)));
  out[(size_t)bh * D + t] = __float2bfloat16(engine_bf16r(o / total) * sig);
"""

# A cache of more than SPLIT_MIN positions is split into chunks of about SPLIT_POSITIONS, a block each (measured
# on an H200 at qwen27b's heads: docs/kernels.md, "Attention decode").
SPLIT_MIN = 512
SPLIT_POSITIONS = 64
MAX_SPLITS = 16


def splits(n: int) -> int:
    """Chunks of positions for a cache of n: 1 up to SPLIT_MIN, then a power of two, at most MAX_SPLITS, of
    about SPLIT_POSITIONS or more."""
    s = 1
    while n > SPLIT_MIN and s < MAX_SPLITS and s * SPLIT_POSITIONS < n:
        s *= 2
    return s


@lru_cache(maxsize=1)
def _keys_kernel():
    return cuda_kernel(
        name="engine_attention_keys",
        input_names=["k", "v", "k_norm_w", "rpar", "fpar"],
        output_names=["k_out", "v_out"],
        source=KEYS_SOURCE,
        header=HEADER,
    )


# `attend`'s kernels by (partial, grouped): name and source
_ATTEND_KERNELS = {
    (False, False): ("engine_attention_attend", ATTEND_SOURCE),
    (True, False): ("engine_attention_partial", PARTIAL_SOURCE),
    (False, True): ("engine_attention_group", GROUP_SOURCE),
    (True, True): ("engine_attention_group_partial", GROUP_PARTIAL_SOURCE),
}


@cache
def _attend_kernel(partial: bool, grouped: bool = False):
    name, source = _ATTEND_KERNELS[partial, grouped]
    return cuda_kernel(
        name=name,
        input_names=["q", "keys", "values", "q_norm_w", "ipar", "rpar", "fpar"],
        output_names=["part_ml", "part_acc"] if partial else ["out"],
        source=source,
        header=HEADER,
    )


@lru_cache(maxsize=1)
def _merge_kernel():
    return cuda_kernel(
        name="engine_attention_merge",
        input_names=["q", "part_ml", "part_acc", "ipar"],
        output_names=["out"],
        source=MERGE_SOURCE,
        header=HEADER,
    )


def refusal(attn: nn.Module) -> str | None:
    """Why the kernels cannot run this attention module (None when they can)."""
    rope, d = getattr(attn, "rope", None), attn.q_norm.weight.shape[0]
    if type(rope) is not nn.RoPE or rope.traditional:
        return "only MLX's default, non-traditional RoPE"
    if d % 32 or d > MAX_HEAD_DIM or rope.dims % 2 or rope.dims > d:
        return f"head dim {d} with rope dims {rope.dims}: a multiple of 32 up to {MAX_HEAD_DIM}, rope dims even"
    if attn.n_heads % attn.n_kv_heads:
        return "q heads must be a multiple of kv heads"
    if any(w.dtype != mx.bfloat16 for w in (attn.q_norm.weight, attn.k_norm.weight)):
        return "bf16 norm weights only"
    if attn.q_norm.eps != attn.k_norm.eps:
        return "the q and k norms must share their eps"
    return None


def float_params(attn) -> mx.array:
    """The kernels' float parameters for `attn`: [norm eps, log2 of the rope base, rope scale, attention scale]."""
    rope = attn.rope
    log2_base = math.log2(float(mx.array(rope.base, dtype=mx.float32).item()))
    return mx.array([attn.q_norm.eps, log2_base, rope.scale, attn.scale], dtype=mx.float32)


@lru_cache(maxsize=4)
def int_params(*values: int) -> mx.array:
    """The kernels' int parameters as an int32 array, made once for a decode step's attention layers (they
    share the positions): an array the host makes is managed memory whose page moves to the GPU when a
    kernel first reads it, once a step here instead of once a layer and kernel. Four values (16 bytes)
    keep it out of MLX's pool for arrays of up to 8 bytes (`quantized_gemv.float_bits`)."""
    return mx.array(values, dtype=mx.int32)


def _template(attn, d: int) -> list:
    return [("H", attn.n_heads), ("HKV", attn.n_kv_heads), ("D", d), ("R", attn.rope.dims), ("WARPS", WARPS)]


@lru_cache(maxsize=4)
def row_params(starts: tuple[int, ...], positions: tuple[int, ...]) -> mx.array:
    """Each batch row's int parameters, [B, 4] int32: its first cache column and its new token's rope position
    (made once a step for all attention layers, as `int_params`)."""
    return mx.array([[s, p, 0, 0] for s, p in zip(starts, positions)], dtype=mx.int32)


def attend_params(n: int, capacity: int) -> tuple[mx.array, int]:
    """`attend`'s int parameters over the first n columns of cache buffers of `capacity` columns, and the
    chunks it splits them into (`splits`)."""
    s = splits(n)
    return int_params(n, capacity, -(-n // s), s), s


def keys(attn, k: mx.array, v: mx.array, rpar: mx.array, fpar: mx.array) -> tuple[mx.array, mx.array]:
    """The new token's k (normed, roped at its row's position in `rpar`, `row_params`) and v, from the
    projections [B, 1, kv heads * D], as [B, kv heads, 1, D] bf16. The positions are an input array, not
    part of the launch, so a compiled step replays for every position."""
    b, d = k.shape[0], attn.k_norm.weight.shape[0]
    shape = (b, attn.n_kv_heads, 1, d)
    return tuple(
        _keys_kernel()(
            inputs=[k, v, attn.k_norm.weight, rpar, fpar],
            template=_template(attn, d),
            grid=(b * attn.n_kv_heads * d, 1, 1),
            threadgroup=(d, 1, 1),
            output_shapes=[shape, shape],
            output_dtypes=[mx.bfloat16, mx.bfloat16],
        )
    )


def attend(
    attn,
    q: mx.array,
    keys_buf: mx.array,
    values_buf: mx.array,
    apar: mx.array,
    rpar: mx.array,
    fpar: mx.array,
    s: int,
    grouped: bool = False,
) -> mx.array:
    """The gated attention output [B, 1, heads * D] (o_proj's input) of q's projection [B, 1, heads * 2 D]
    (q and the gate per head) over each row's columns [start, n) of the cache buffers [B, kv heads, cap, D],
    where `(apar, s) = attend_params(n, cap)` and `rpar = row_params(starts, positions)`: one launch, or for
    a long cache (s > 1 chunks) one over chunks of the columns and one that merges them. Only s shapes the
    launches; the positions are in the inputs. `grouped`: a block per kv head for all its q heads instead of
    a block per q head (the same values, the keys and values read once for the group)."""
    b, d, heads = q.shape[0], attn.q_norm.weight.shape[0], attn.n_heads
    inputs = [q, keys_buf, values_buf, attn.q_norm.weight, apar, rpar, fpar]
    blocks = b * (attn.n_kv_heads if grouped else heads) * s
    launch = dict(template=_template(attn, d), grid=(blocks * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1))
    if s == 1:
        return _attend_kernel(False, grouped)(
            inputs=inputs, output_shapes=[(b, 1, heads * d)], output_dtypes=[mx.bfloat16], **launch
        )[0]
    ml, acc = _attend_kernel(True, grouped)(
        inputs=inputs,
        output_shapes=[(b * heads * s * 2,), (b * heads * s, d)],
        output_dtypes=[mx.float32, mx.float32],
        **launch,
    )
    return _merge_kernel()(
        inputs=[q, ml, acc, apar],
        template=[("D", d)],
        grid=(b * heads * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[(b, 1, heads * d)],
        output_dtypes=[mx.bfloat16],
    )[0]
