"""The GEMV kernel's own time on the GPU, read from the global timer (%globaltimer, ns) inside it, beside
the wall time per call that `harness kernels` measures (`calls` calls an evaluation, weights cold).

Each block records when it started and ended. Per call that gives the kernel's device time (first block
start to last block end), when its last block started (waves) and its tail (90% of blocks done to the
last); per evaluation, the time the device was busy with these calls at all (the union of their spans,
over the calls) and the idle gaps between them. Consecutive independent calls overlap on the device (MLX's
CUDA graphs let them), so busy time per call, not one call's span, is what the kernel costs in a stream.
A read-only kernel (16-byte streaming loads, nothing else) over the same weights calibrates what this
machine's memory delivers to a kernel measured this way.

Caveat, measured on the H200 (reports/gpu/gemv-clock-calls-qwen27b.txt): reading the timer perturbs what
it measures. Evaluations of clocked calls took up to 3x the wall time of the same calls unclocked (busy
per call above wall per call) where a launch has many blocks (17408x5120: 1088 blocks; the read kernel:
2722), and agreed where it has few (5120x17408: 320). Use it for the order of events (calls overlapping,
waves, tails), not for rates; the wall times are the rates.

    source .device-kit/b/env.sh && python3 harness/gpu/diag_gemv_clock.py [--quick] [--calls 50,200]
"""

import argparse
import statistics
from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.kernels import quantized_gemv as qg
from harness.gpu.diag_gemv_configs import label
from harness.gpu.results import save_json
from harness.kernel_bench import BenchConfig, random_quantized, time_us, weight_copies

CLOCK_START = r"""  unsigned long long engine_t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(engine_t0));
"""
CLOCK_END = r"""  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long engine_t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(engine_t1));
    clock[2 * blockIdx.x] = engine_t0;
    clock[2 * blockIdx.x + 1] = engine_t1;
  }
"""
ANCHOR = "  const int warp = threadIdx.x >> 5;\n"
READ_UNROLL = 4
READ = r"""
  // Streams the array once: each thread READ_UNROLL 16-byte loads, a warp's load one contiguous 512 bytes.
""" + CLOCK_START + r"""
  const uint4* p = reinterpret_cast<const uint4*>(a);
  const size_t base = (size_t)blockIdx.x * blockDim.x * READ_UNROLL + threadIdx.x;
  uint4 v[READ_UNROLL];
  #pragma unroll
  for (int u = 0; u < READ_UNROLL; ++u) {
    const size_t i = base + (size_t)u * blockDim.x;
    v[u] = i < NV ? __ldcs(p + i) : make_uint4(0, 0, 0, 0);
  }
  uint32_t x = 0;
  #pragma unroll
  for (int u = 0; u < READ_UNROLL; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (x == 0x9E3779B9u) out[0] = x;  // keeps the loads
""" + CLOCK_END


@lru_cache(maxsize=None)
def clocked_gemv():
    source = qg.kernel_source(1, qg.Fusion())
    assert ANCHOR in source
    return mx.fast.cuda_kernel(
        name="engine_qmm_clocked", input_names=qg.input_names(1), output_names=["out0", "clock"],
        source=source.replace(ANCHOR, CLOCK_START + ANCHOR) + CLOCK_END, header=qg.HEADER,
    )


@lru_cache(maxsize=None)
def clocked_read():
    return mx.fast.cuda_kernel(name="engine_read_clocked", input_names=["a"], output_names=["out", "clock"], source=READ)


def gemv_call(x, triple, config):
    args = qg.launch_arguments(x, [triple], 64, 4, config)
    blocks = args["grid"][0] // args["threadgroup"][0]
    args["output_shapes"].append((2 * blocks,))
    args["output_dtypes"].append(mx.uint64)
    return clocked_gemv()(**args)[1]


def read_call(triple):
    a = triple[0]
    nv = a.size // 4
    blocks = -(-nv // (256 * READ_UNROLL))
    return clocked_read()(inputs=[a], template=[("NV", nv), ("READ_UNROLL", READ_UNROLL)], grid=(blocks * 256, 1, 1),
                          threadgroup=(256, 1, 1), output_shapes=[(1,), (2 * blocks,)],
                          output_dtypes=[mx.uint32, mx.uint64])[1]  # fmt: skip


def union_us(spans) -> tuple[float, list]:
    """Total time covered by the (start, end) spans, and the idle gaps between them, in us."""
    busy, gaps = 0, []
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end) / 1e3)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return (busy + cur_end - cur_start) / 1e3, gaps


def device_times(call, weights, calls: int, repeats: int) -> dict:
    """Per call, in us: busy (the union of the calls' spans over the calls), span (first start to last
    end, over the calls), and medians of one call's span, its last block's start and its tail; the idle
    gaps of more than 2 us between calls (count and sum per evaluation)."""
    rows = {k: [] for k in ("busy_us", "span_us", "call_us", "last_start_us", "tail_us", "idle_gaps", "idle_us")}
    for rep in range(repeats + 1):
        clocks = [call(weights()) for _ in range(calls)]
        mx.eval(clocks)
        if rep == 0:
            continue  # compiles
        spans = []
        for c in clocks:
            t = np.array(c).astype(np.int64).reshape(-1, 2)
            start, end = t[:, 0].min(), t[:, 1].max()
            spans.append((start, end))
            rows["call_us"].append((end - start) / 1e3)
            rows["last_start_us"].append((t[:, 0].max() - start) / 1e3)
            rows["tail_us"].append((end - np.percentile(t[:, 1], 90)) / 1e3)
        spans.sort()
        busy, gaps = union_us(spans)
        rows["busy_us"].append(busy / calls)
        rows["span_us"].append((spans[-1][1] - spans[0][0]) / 1e3 / calls)
        rows["idle_gaps"].append(sum(g > 2 for g in gaps))
        rows["idle_us"].append(sum(g for g in gaps if g > 2))
    return {k: round(float(statistics.median(v)), 2) for k, v in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="the two 50 MB matrices at M = 1 only")
    p.add_argument("--calls", default="50,200", help="calls per evaluation, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cases = [(17408, 5120, 1), (5120, 17408, 1), (248320, 5120, 1), (6144, 5120, 1), (17408, 5120, 8)]
    results = []
    for n, k, m in cases[:2] if args.quick else cases:
        w, s, b = random_quantized(n, k, 4, 64)
        nbytes = w.nbytes + s.nbytes + b.nbytes
        weights = weight_copies(w, s, b, BenchConfig())  # the copies depend only on cold_bytes
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        mx.eval(x)
        config = qg.launch_config(m, k, 64, 4, n)
        for calls in map(int, args.calls.split(",")):
            cfg = BenchConfig(calls=calls, repeats=args.repeats)
            timed = {
                "mlx": (nbytes, lambda: mx.quantized_matmul(x, *weights(), transpose=True, group_size=64, bits=4), None),
                "kernel": (nbytes, lambda: qg.quantized_matmul(x, *weights(), 64, 4), lambda t: gemv_call(x, t, config)),
                "read": (w.nbytes, lambda: read_call(weights()), read_call),
            }
            for name, (size, fn, call) in timed.items():
                wall = time_us(fn, cfg)
                dev = device_times(call, weights, calls, args.repeats) if call else {}
                row = {"n": n, "k": k, "m": m, "calls": calls, "what": name, "config": label(config), "mb": size / 1e6,
                       "wall_us": round(wall, 2), **dev}  # fmt: skip
                results.append(row)
                line = f"{n}x{k} M={m} {calls:3d} calls {name:6s} ({size / 1e6:5.1f} MB): wall {wall:6.1f} us {size / wall / 1e3:5.0f} GB/s"
                if dev:
                    line += (f" | busy {dev['busy_us']:6.1f} us {size / dev['busy_us'] / 1e3:5.0f} GB/s, span {dev['span_us']:6.1f}, "
                             f"one call {dev['call_us']:6.1f} (last block starts {dev['last_start_us']:5.1f}, tail "
                             f"{dev['tail_us']:4.1f}), idle gaps {dev['idle_gaps']:.0f} = {dev['idle_us']:.0f} us")
                print(line, flush=True)
                save_json("gemv-clock.json", results)


if __name__ == "__main__":
    main()
