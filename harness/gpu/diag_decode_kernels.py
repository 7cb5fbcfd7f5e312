"""Which kernels a B=1 decode step runs on the device, and for how long.

    source .device-kit/b/env.sh && nsys profile --capture-range=cudaProfilerApi -o /tmp/decode \\
        python3 harness/gpu/diag_decode_kernels.py --config fast_step_kernel
    python3 harness/gpu/diag_decode_kernels.py --summarize /tmp/decode_trace.csv

The first form runs a warmed-up pipelined decode of `--tokens` steps between cudaProfilerStart and
cudaProfilerStop, so Nsight Systems records only those steps. The second reads the GPU trace that
`nsys stats --report cuda_gpu_trace --format csv` wrote and prints per step: kernels launched, the
device's busy time (kernels' own durations), the span from the first kernel's start to the last one's
end, and the idle time between kernels; then the kernels by total time. (`PART=profile bash
harness/gpu/kernels_qwen27b.sh` does both.)
"""

import argparse
import csv
import ctypes
import re
import statistics
from collections import defaultdict


def _cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def record(config: str, tokens: int) -> None:
    import mlx.core as mx

    from engine.engine import Engine
    from engine.kernels import EXACT, attention_decode, gated_delta_decode, install, quantized_gemv
    from harness.gpu.diag_decode_step import CONFIGS

    eng = Engine.load("qwen27b", with_tokenizer=False)
    tier, gated_delta_decode.USE_STEP_KERNEL, attention_decode.ENABLED, quantized_gemv.FUSE = CONFIGS[config]
    install(eng.model, EXACT)
    install(eng.model, tier)
    prompt = [(i * 7919) % 50000 + 10 for i in range(256)]
    list(eng.generate(prompt, max_tokens=16, ignore_eos=True))  # compiles this shape's kernels
    cudart = _cudart()
    print(f"cudart for the capture range: {cudart}", flush=True)
    steps = eng.generate(prompt, max_tokens=tokens + 8, ignore_eos=True)
    for _ in range(8):  # the prefill and the first steps stay outside the capture
        next(steps)
    mx.synchronize()
    if cudart:
        cudart.cudaProfilerStart()
    for _ in steps:
        pass
    mx.synchronize()
    if cudart:
        cudart.cudaProfilerStop()


def _kernel_name(name: str) -> str:
    return re.sub(r"<.*", "", name)[:90]


def summarize(path: str, tokens: int) -> None:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("Name") and not r["Name"].startswith("[CUDA mem")]
    rows.sort(key=lambda r: int(r["Start (ns)"]))
    starts = [int(r["Start (ns)"]) for r in rows]
    durations = [int(r["Duration (ns)"]) for r in rows]
    span = starts[-1] + durations[-1] - starts[0]
    busy = sum(durations)
    print(f"{len(rows)} kernels over {tokens} steps: {len(rows) / tokens:.0f} a step; span {span / 1e6 / tokens:.2f} ms "
          f"a step, kernels busy {busy / 1e6 / tokens:.2f} ms a step ({busy / span:.0%}); idle between kernels "
          f"{(span - busy) / 1e6 / tokens:.2f} ms a step")
    gaps = [max(0, b - (a + d)) for a, d, b in zip(starts, durations, starts[1:])]
    print(f"gap between consecutive kernels: median {statistics.median(gaps) / 1e3:.1f} us, "
          f"p90 {sorted(gaps)[int(0.9 * len(gaps))] / 1e3:.1f} us, gaps over 50 us: {sum(g > 50e3 for g in gaps)} "
          f"({sum(g for g in gaps if g > 50e3) / 1e6 / tokens:.2f} ms a step)")
    by_name = defaultdict(list)
    for r, d in zip(rows, durations):
        by_name[_kernel_name(r["Name"])].append(d)
    print(f"{'kernel':90s} {'a step':>7s} {'us each':>8s} {'ms a step':>9s}")
    for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]:
        print(f"{name:90s} {len(ds) / tokens:7.1f} {statistics.median(ds) / 1e3:8.1f} {sum(ds) / 1e6 / tokens:9.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="fast_step_kernel", help="a configuration of diag_decode_step.CONFIGS")
    p.add_argument("--tokens", type=int, default=32, help="decode steps inside the capture")
    p.add_argument("--summarize", metavar="TRACE_CSV", help="print the summary of an exported GPU trace instead")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.tokens)
    else:
        record(args.config, args.tokens)


if __name__ == "__main__":
    main()
