"""The GEMV kernel's own time on the GPU, read from the global timer (%globaltimer, ns) inside it, beside
the wall time per call that `harness kernels` measures (50 calls an evaluation, weights cold).

Each block records when it started and ended; per call that gives the kernel's device time (first block
start to last block end), the gap to the next call's first block (what MLX's launches cost on the device),
when the last block started (waves), and the tail (from 90% of blocks done to the last). The kernel table's
fit of M = 1 times (11 us a launch + bytes at 2.9 TB/s) does not say which of these the 11 us is.

Layouts: the register loads (`LaunchConfig(W, RT, U)`) and the staged ones through shared memory
(`stages` > 0); the staged results must equal the register ones bit for bit (same sums in the same order).

    source .device-kit/b/env.sh && python3 harness/gpu/diag_gemv_clock.py [--quick]
"""

import argparse
import statistics
from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.kernels import quantized_gemv as qg
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


@lru_cache(maxsize=None)
def clocked(staged: bool):
    source = qg.kernel_source(1, qg.Fusion(), staged)
    assert ANCHOR in source
    return mx.fast.cuda_kernel(
        name="engine_qmm_clocked" + "_st" * staged, input_names=qg.input_names(1), output_names=["out0", "clock"],
        source=source.replace(ANCHOR, CLOCK_START + ANCHOR) + CLOCK_END, header=qg.HEADER,
    )


def clocked_call(x, triple, config):
    args = qg.launch_arguments(x, [triple], 64, 4, config)
    blocks = args["grid"][0] // args["threadgroup"][0]
    args["output_shapes"].append((2 * blocks,))
    args["output_dtypes"].append(mx.uint64)
    return clocked(config.stages > 0)(**args)


def device_times(x, weights, config, calls: int, repeats: int) -> dict:
    """Median over calls and repeats of each call's device time and what surrounds it, in us."""
    rows = {"device_us": [], "gap_us": [], "last_start_us": [], "tail_us": [], "block_us": []}
    for rep in range(repeats + 1):
        clocks = [clocked_call(x, weights(), config)[1] for _ in range(calls)]
        mx.eval(clocks)
        if rep == 0:
            continue  # compiles
        spans = []
        for c in clocks:
            t = np.array(c).astype(np.int64).reshape(-1, 2)
            start, end = t[:, 0].min(), t[:, 1].max()
            spans.append((start, end))
            rows["device_us"].append((end - start) / 1e3)
            rows["last_start_us"].append((t[:, 0].max() - start) / 1e3)
            rows["tail_us"].append((end - np.percentile(t[:, 1], 90)) / 1e3)
            rows["block_us"].append(float(np.median(t[:, 1] - t[:, 0])) / 1e3)
        spans.sort()
        rows["gap_us"] += [(b[0] - a[1]) / 1e3 for a, b in zip(spans, spans[1:])]
    return {k: round(statistics.median(v), 2) for k, v in rows.items()}


def label(c: qg.LaunchConfig) -> str:
    return f"W{c.warps} RT{c.row_tiles} U{c.batch}" + (f" ST{c.stages}" if c.stages else "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="17408x5120 at M = 1 only")
    p.add_argument("--rounds", type=int, default=2, help="times through the layouts (the machine drifts)")
    args = p.parse_args()
    cfg = BenchConfig(calls=50, repeats=7)
    m1 = [qg.LaunchConfig(4, 1, 4)] + [qg.LaunchConfig(*s) for s in
                                       ((4, 1, 4, 0, 4), (4, 1, 4, 0, 3), (2, 1, 8, 0, 4), (4, 1, 2, 0, 4),
                                        (8, 1, 2, 0, 4), (2, 1, 4, 0, 4), (4, 1, 2, 0, 3))]  # fmt: skip
    m8 = [qg.LaunchConfig(4, 2, 4), qg.LaunchConfig(4, 2, 8), qg.LaunchConfig(4, 1, 4, 0, 4), qg.LaunchConfig(4, 1, 2, 0, 4)]
    cases = [(17408, 5120, 1, m1), (5120, 17408, 1, m1), (248320, 5120, 1, m1[:4]), (6144, 5120, 1, m1[:5]),
             (17408, 5120, 8, m8), (5120, 17408, 8, m8)]  # fmt: skip
    results = []
    for n, k, m, configs in cases[:1] if args.quick else cases:
        w, s, b = random_quantized(n, k, 4, 64)
        nbytes = w.nbytes + s.nbytes + b.nbytes
        weights = weight_copies(w, s, b, cfg)
        x = mx.random.normal((m, k)).astype(mx.bfloat16)
        mx.eval(x)
        configs = [c for c in configs if c.refusal(k, 64, 4) is None]
        plain = qg.quantized_matmul(x, w, s, b, 64, 4, config=configs[0])
        for c in configs[1:]:
            same = mx.array_equal(qg.quantized_matmul(x, w, s, b, 64, 4, config=c), plain).item()
            print(f"{n}x{k} M={m} {label(c)}: {'equal' if same else 'DIFFERENT'} to {label(configs[0])}", flush=True)
        mlx_us = time_us(lambda: mx.quantized_matmul(x, *weights(), transpose=True, group_size=64, bits=4), cfg)
        print(f"{n}x{k} M={m} ({nbytes / 1e6:.1f} MB): MLX {mlx_us:.1f} us wall ({nbytes / mlx_us / 1e3:.0f} GB/s)", flush=True)
        for rnd in range(args.rounds):
            for c in configs:
                wall = time_us(lambda: qg.quantized_matmul(x, *weights(), 64, 4, config=c), cfg)
                dev = device_times(x, weights, c, cfg.calls, 3)
                row = {"n": n, "k": k, "m": m, "mb": nbytes / 1e6, "config": label(c), "round": rnd, "wall_us": round(wall, 2),
                       "mlx_us": round(mlx_us, 2), **dev}  # fmt: skip
                results.append(row)
                print(f"  {label(c):16s} wall {wall:6.1f} us {nbytes / wall / 1e3:5.0f} GB/s | device {dev['device_us']:6.1f} us "
                      f"{nbytes / dev['device_us'] / 1e3:5.0f} GB/s, gap {dev['gap_us']:5.1f}, last block starts "
                      f"{dev['last_start_us']:5.1f}, tail {dev['tail_us']:4.1f}, block {dev['block_us']:5.1f}", flush=True)
                save_json("gemv-clock.json", results)


if __name__ == "__main__":
    main()
