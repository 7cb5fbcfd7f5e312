"""Whether one launch with a grid-wide barrier costs less than two dependent launches: the experiment
behind merging a layer's GEMV launches (the runbook's "Next", seventeenth session).

    source .device-kit/b/env.sh && python3 harness/gpu/diag_launch_merge.py

Under Nsight Compute each of a decode step's GEMV launches takes 7-11 us more than its bytes at the rate
the lm head's single large launch streams (3.56 TB/s), ~2.3 ms of a 7.19 ms step: the start and the end of
each of ~375 dependent launches. A launch whose blocks all stay resident could run two dependent phases
with a barrier between them, loading the second phase's first weights (which do not depend on the first
phase) before it waits. This times that against two launches on a stand-in for an MLP at qwen27b's sizes:

- phase A: 17408 rows of 5120 bytes (gate+up's 89 MB at 4 bits), each row's sum over its 16-byte chunks
  of (the chunk's bits folded to a number) x (an activation), one warp a row, into y;
- phase B: 5120 rows of 8704 bytes (down's 44.6 MB), the same against y, into z, which is the next
  layer's input. Layers take COPIES distinct weight sets in turn (more than the L2 holds).

Variants, each a chain of LAYERS layers a evaluation, none starting before the one before ends:
`two launches` (a block of W warps per W rows), `two launches, resident` (the same, but SMS x BPS blocks
looping over the rows, as the merged form must), `merged` (one resident launch: A, a barrier, B) and
`merged + prefetch` (B's first batch of loads issued before the barrier). `two launches, resident` against
`merged` is the launch boundary against the barrier, the rest equal (resident warps take 4-5 rows each, so
both have the same uneven end); against `two launches` it is also the grid's shape. Every variant gives the same
bits (each row's sum in one order): checked first, so a broken barrier shows. The barrier gives up after
~1 s of spinning (blocks not all resident: lower BPS) and says so. Rows go to $OUT/launch-merge.json.
"""

import os
import statistics
import sys

import mlx.core as mx

from engine.kernels.cuda_source import cuda_kernel
from engine.kernels.quantized_gemv import launch_bounds
from harness.gpu.results import save_json
from harness.kernel_bench import BenchConfig, serial_us

NA, RA = 17408, 5120  # phase A: rows, bytes a row
NB, RB = 5120, 8704  # phase B
W, U = 8, 4  # warps a block (a warp a row), 16-byte loads a lane in flight
SMS = int(os.environ.get("SMS", "132"))  # the H200's
BPS = int(os.environ.get("BPS", "4"))  # resident blocks an SM: 4 x 256 threads at <= 64 registers
LAYERS, COPIES, ROUNDS = (int(os.environ.get(k, d)) for k, d in (("LAYERS", "64"), ("COPIES", "4"), ("ROUNDS", "3")))

HEADER = r"""
template <int U> struct Batch { uint4 v[U]; };

// in [-1, 1): with random signs a row's sum grows ~10-14x a phase, so a chain of layers stays finite
__device__ __forceinline__ float chunk_value(const uint4 w) {
  return (float)((int)((w.x ^ w.y ^ w.z ^ w.w) & 0xFFFFu) - 32768) * (1.0f / 32768.0f);
}

// lane's chunks (lane, lane + 32, ...) of a row of CHUNKS 16-byte chunks, U loads issued before their math;
// the first batch taken from `pre` when `use_pre`. The warp's sum, in the same order whatever the grid.
template <int CHUNKS, int U, bool CG>
__device__ __forceinline__ float row_dot(const uint4* w, const float* act, const int act_len, const int lane,
                                         const Batch<U>& pre, const bool use_pre) {
  constexpr int PER_LANE = (CHUNKS + 31) / 32;
  float acc = 0.0f;
  #pragma unroll 1
  for (int b = 0; b < PER_LANE; b += U) {
    uint4 v[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (b + u) * 32 + lane;
      v[u] = (use_pre && b == 0) ? pre.v[u] : (b + u < PER_LANE && c < CHUNKS) ? __ldcs(w + c) : make_uint4(0, 0, 0, 0);
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (b + u) * 32 + lane;
      if (b + u < PER_LANE && c < CHUNKS) {
        const int i = (c * 32) % act_len;
        acc = fmaf(chunk_value(v[u]), CG ? __ldcg(act + i) : __ldg(act + i), acc);
      }
    }
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

template <int N, int CHUNKS, int W, int U, bool CG>
__device__ __forceinline__ void phase(const uint32_t* w, const float* act, const int act_len, float* out,
                                      const Batch<U>& pre, const bool use_pre) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bool first = use_pre;
  for (int row = blockIdx.x * W + warp; row < N; row += gridDim.x * W) {
    const float s = row_dot<CHUNKS, U, CG>(reinterpret_cast<const uint4*>(w) + (size_t)row * CHUNKS, act, act_len,
                                           lane, pre, first);
    first = false;
    if (lane == 0) out[row] = s;
  }
}

// All blocks of the grid meet: bar[0] counts arrivals, bar[1] is the generation the last arrival moves on
// (and that block sets bar[0] back to 0 first), bar[2] is set if a block gave up waiting.
__device__ __forceinline__ void grid_barrier(const int* bar_in) {
  int* bar = const_cast<int*>(bar_in);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile int* gen = bar + 1;
    const int seen = *gen;
    __threadfence();
    if (atomicAdd(bar, 1) == (int)gridDim.x - 1) {
      bar[0] = 0;
      __threadfence();
      atomicAdd(bar + 1, 1);
    } else {
      for (long spin = 0; *gen == seen; ++spin) {
        if (spin > (1l << 23)) { bar[2] = 1; break; }
        __nanosleep(100);
      }
    }
    __threadfence();
  }
  __syncthreads();
}
"""

_PRE = "  Batch<U> pre;\n"
PHASE_A = _PRE + "  phase<NA, RA / 16, W, U, false>(wa, x, NB, y, pre, false);\n"
PHASE_B = _PRE + "  phase<NB, RB / 16, W, U, false>(wb, y, NA, z, pre, false);\n"
MERGED = _PRE + r"""
  phase<NA, RA / 16, W, U, false>(wa, x, NB, y, pre, false);
  if (PREFETCH) {  // B's first batch of this warp's first row, before the barrier: the weights do not wait for y
    const int row = blockIdx.x * W + threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint4* w = reinterpret_cast<const uint4*>(wb) + (size_t)row * (RB / 16);
    #pragma unroll
    for (int u = 0; u < U; ++u) pre.v[u] = row < NB ? __ldcs(w + u * 32 + lane) : make_uint4(0, 0, 0, 0);
  }
  grid_barrier(bar);
  phase<NB, RB / 16, W, U, true>(wb, y, NA, z, pre, PREFETCH);
"""


def kernels():
    header = HEADER + launch_bounds(W * 32, BPS)
    return {
        "a": cuda_kernel(name="diag_merge_a", input_names=["x", "wa"], output_names=["y"], source=PHASE_A, header=header),
        "b": cuda_kernel(name="diag_merge_b", input_names=["y", "wb"], output_names=["z"], source=PHASE_B, header=header),
        "ab": cuda_kernel(name="diag_merge_ab", input_names=["x", "wa", "wb", "bar"], output_names=["y", "z"],
                          source=MERGED, header=header),
    }  # fmt: skip


def variant_step(ks, weights, bar, label: str):
    """One layer a call (x: [NB] float32 -> z: [NB]), weight sets in turn."""
    turn = [0]
    template = [("NA", NA), ("RA", RA), ("NB", NB), ("RB", RB), ("W", W), ("U", U)]
    resident = SMS * BPS * W * 32

    def step(x: mx.array) -> mx.array:
        wa, wb = weights[turn[0]]
        turn[0] = (turn[0] + 1) % len(weights)
        if label.startswith("merged"):
            return ks["ab"](inputs=[x, wa, wb, bar], template=template + [("PREFETCH", int("prefetch" in label))],
                            grid=(resident, 1, 1), threadgroup=(W * 32, 1, 1), output_shapes=[(NA,), (NB,)],
                            output_dtypes=[mx.float32, mx.float32])[1]  # fmt: skip
        grid_a, grid_b = (resident, resident) if "resident" in label else (NA * 32, NB * 32)
        y = ks["a"](inputs=[x, wa], template=template, grid=(grid_a, 1, 1), threadgroup=(W * 32, 1, 1),
                    output_shapes=[(NA,)], output_dtypes=[mx.float32])[0]  # fmt: skip
        return ks["b"](inputs=[y, wb], template=template, grid=(grid_b, 1, 1), threadgroup=(W * 32, 1, 1),
                       output_shapes=[(NB,)], output_dtypes=[mx.float32])[0]  # fmt: skip

    return step


VARIANTS = ["two launches", "two launches, resident", "merged", "merged + prefetch"]


def main():
    if not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        sys.exit("diag_launch_merge: needs MLX's CUDA backend")
    mx.random.seed(0)
    weights = [(mx.random.randint(0, 2**31, (NA, RA // 4), dtype=mx.uint32),
                mx.random.randint(0, 2**31, (NB, RB // 4), dtype=mx.uint32)) for _ in range(COPIES)]  # fmt: skip
    bar = mx.zeros((3,), dtype=mx.int32)
    mx.eval(weights, bar)
    ks = kernels()
    start = mx.random.uniform(shape=(NB,)) * 1e-6
    outs = {}
    for label in VARIANTS:  # the same bits from every variant, or the barrier let B read y too early
        h, step = start, variant_step(ks, weights, bar, label)
        for _ in range(2 * COPIES):
            h = step(h)
        mx.eval(h)
        if not mx.all(mx.isfinite(h)).item():  # inf or nan compares unequal to itself: the check would mean nothing
            sys.exit(f"{label}: the chain's output is not finite")
        outs[label] = h
        if bar[2].item():
            sys.exit(f"{label}: a block gave up at the barrier (not all {SMS} x {BPS} blocks resident?)")
    base = outs[VARIANTS[0]]
    for label in VARIANTS[1:]:
        print(f"{label}: {'same bits' if mx.array_equal(outs[label], base).item() else 'DIFFERENT'} "
              f"as two launches", flush=True)  # fmt: skip
    cfg = BenchConfig(repeats=7, calls=LAYERS)
    times = {label: [] for label in VARIANTS}
    for r in range(ROUNDS):
        for label in VARIANTS:
            times[label].append(serial_us(variant_step(ks, weights, bar, label), start, cfg))
        print(f"round {r + 1}: " + " | ".join(f"{k} {v[-1]:.1f}" for k, v in times.items()), flush=True)
    mb = (NA * RA + NB * RB) / 1e6
    base_us = statistics.median(times[VARIANTS[0]])
    rows = []
    print(f"{'variant':<24} {'us a layer':>10} {'TB/s':>6} {'ratio':>6}   rounds ({mb:.1f} MB a layer)")
    for label in VARIANTS:
        med = statistics.median(times[label])
        rows.append({"variant": label, "us": med, "tbs": mb / med, "ratio": med / base_us, "rounds": times[label],
                     "mb": mb, "sms": SMS, "bps": BPS, "layers": LAYERS})  # fmt: skip
        print(f"{label:<24} {med:>10.1f} {mb / med:>6.2f} {med / base_us:>6.3f}   "
              + " ".join(f"{v:.1f}" for v in times[label]))  # fmt: skip
    save_json("launch-merge.json", rows)


if __name__ == "__main__":
    main()
