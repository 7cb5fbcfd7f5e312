"""Where a fast decode step's device time goes, kernel by kernel, under Nsight Compute.

Run under `ncu`:

    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none \\
        --log-file ncu.csv python3 -m tools.gpu.step_kernels
    python3 -m tools.gpu.step_kernels --summarize ncu.csv

The first command loads the model (fast tier), prefills `--prompt-tokens` (64), warms the decode step, then
evaluates `--steps` decode steps one at a time with a marker kernel after each. The second reads ncu's CSV: each step's kernels
are those between two markers; it prints the sum of their durations per step (the device's busy time,
kernels serialized by ncu, clocks and caches as the application leaves them) and the kernels that take the
most, by name (each one's median, fastest and slowest launch). Set against the pipelined step time (`tools.gpu.decode_step`), the sum says whether the device
is busy for the whole step or waits between launches.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict

MARKER = "engine_step_marker"
UNITS_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def _marker():
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=MARKER, input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    return lambda x: kernel(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                            output_dtypes=[x.dtype])[0]  # fmt: skip


def run(model_name: str, steps: int, tier: str, prompt_tokens: int = 64) -> None:
    import mlx.core as mx

    from engine.engine import Engine
    from engine.kernels import KernelConfig

    eng = Engine.load(model_name, with_tokenizer=False, kernels=KernelConfig.from_env(tier))
    ks = eng.kernels
    print(f"{model_name}: {ks}", flush=True)
    marker = _marker()
    cache = eng.make_cache()
    logits = eng.model(mx.array([[(i * 7919) % 50000 + 10 for i in range(prompt_tokens)]]), cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    for _ in range(3):  # warm: compiles the step's kernels
        token = mx.argmax(eng.model(token, cache)[:, -1:], axis=-1)
        mx.eval(token)
    mx.eval(marker(token.reshape(-1)))
    for _ in range(steps):
        token = mx.argmax(eng.model(token, cache)[:, -1:], axis=-1)
        mx.eval(token)
        mx.eval(marker(token.reshape(-1)))
    print(f"{steps} steps done", flush=True)


def summarize(path: str, top: int) -> None:
    rows = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            scale = UNITS_US.get(row["Metric Unit"], float("nan"))
            rows.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale))
    marks = [i for i, (name, _) in enumerate(rows) if MARKER in name]
    if len(marks) < 2:
        raise SystemExit(f"{path}: {len(marks)} markers among {len(rows)} kernels; nothing between two markers")
    per_step, by_name, launches = [], defaultdict(list), []
    for a, b in zip(marks, marks[1:]):
        step = rows[a + 1 : b]
        per_step.append(sum(us for _, us in step))
        launches.append(len(step))
        for name, us in step:
            by_name[name.split("(")[0][:90]].append(us)
    n = len(per_step)
    print(f"{n} steps: {launches[0]} kernels a step; device busy {statistics.median(per_step) / 1e3:.2f} ms a step "
          f"(median; {min(per_step) / 1e3:.2f}-{max(per_step) / 1e3:.2f})")
    # us each: the median launch, beside the fastest and slowest (a name whose fastest launch is as far above
    # another build's as its median is slower in every launch; a slow median over a fast minimum, in some)
    print(f"{'kernel':90s} {'a step':>7s} {'us a step':>10s} {'us each':>9s} {'min':>7s} {'max':>7s}")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{name:90s} {len(times) / n:7.1f} {sum(times) / n:10.1f} {statistics.median(times):9.1f} "
              f"{min(times):7.1f} {max(times):7.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tier", default="fast", help="kernel tier (the fast tier takes ENGINE_FUSE and ENGINE_GEMV_LAUNCH)")
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="the context the decode steps attend over (native's is 1024 and more)")
    p.add_argument("--summarize", metavar="NCU_CSV", help="read ncu's CSV instead of running the model")
    p.add_argument("--top", type=int, default=25, help="kernels to list, most time first")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        run(args.model, args.steps, args.tier, args.prompt_tokens)


if __name__ == "__main__":
    main()
