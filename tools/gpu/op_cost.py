"""The host's cost of one MLX operation, by kind: building it in Python and submitting it (`mx.async_eval`).

    python3 -m tools.gpu.op_cost [--ops 400] [--reps 7] [--kinds add,compiled,...] [--label NAME]

A decode step at one row is a few hundred operations (the engine's kernels and the compiled stages between them),
and its host time (`tools.gpu.step_kernels --time`) can pass its device time. This times chains of `--ops`
operations of one kind on a [1, 5120] bfloat16 row, each chain built, submitted with nothing in flight, then
waited for; a line per kind gives the median microseconds an operation to build, to submit and to wait. Kinds
(default all; off CUDA the custom kernels are skipped and said to be):

    add            x + 1 (one MLX elementwise kernel)
    compiled       an `mx.compile`d function of four elementwise operations (one fused kernel)
    kernel         a custom kernel (`mx.fast.cuda_kernel`, CUDA only) of a few lines
    kernel_source  the same kernel with ~9 KB of unused source, as long as the engine's matrix kernel
    kernel_inputs  the same kernel with 12 inputs, as many arrays as a fused launch's weights, scales and biases
    gemv           the engine's quantized matmul launch at one row (gate and up with their SwiGLU, 4-bit
                   5120x5120 matrices), as a decode step's layers call it outside their compiled calls

MLX's CUDA backend reads its graph settings once a process (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER,
MLX_CUDA_GRAPH_CACHE_SIZE): compare them one process each; `--label` names the run in the output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

WIDTH = 5120
KINDS = ("add", "compiled", "kernel", "kernel_source", "kernel_inputs", "gemv")
KERNEL_KINDS = {"kernel", "kernel_source", "kernel_inputs", "gemv"}
EXTRA_INPUTS = 11


def unused_source(size: int) -> str:
    """`size` bytes or more of device functions nothing calls (the kernel's hashed, never-run source)."""
    parts, n = [], 0
    while n < size:
        part = f"__device__ float engine_unused_{len(parts)}(float a, float b) {{ return a * {len(parts)}.5f + b; }}\n"
        parts.append(part)
        n += len(part)
    return "".join(parts)


def step_for(kind: str) -> Callable[[mx.array, list[mx.array]], mx.array]:
    """One operation of `kind` on x (`extra`: the arrays a many-input kernel also takes)."""
    if kind == "add":
        return lambda x, extra: x + 1
    if kind == "compiled":
        fused = mx.compile(lambda x: ((x * 2 + 1) * 0.5 - 0.25).astype(mx.bfloat16))
        return lambda x, extra: fused(x)
    if kind == "gemv":
        from engine.kernels.quantized_gemv import quantized_matmuls
        from harness.kernels.bench import random_quantized

        pair = [random_quantized(WIDTH, WIDTH, 4, 64) for _ in range(2)]
        return lambda x, extra: quantized_matmuls(x, pair, 64, 4, gated=True)[0]
    names = ["x"] + [f"w{i}" for i in range(EXTRA_INPUTS if kind == "kernel_inputs" else 0)]
    kernel = mx.fast.cuda_kernel(
        name=f"engine_op_cost_{kind}",
        input_names=names,
        output_names=["y"],
        header=unused_source(9000) if kind == "kernel_source" else "",
        source="unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < N) y[i] = x[i] + (T)1;",
    )

    def step(x, extra):
        inputs = [x] + extra[: len(names) - 1]
        return kernel(
            inputs=inputs,
            template=[("T", x.dtype), ("N", x.size)],
            grid=(WIDTH, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0]

    return step


def time_kind(kind: str, ops: int, reps: int) -> dict:
    """Median microseconds an operation to build, submit and wait for, over `reps` chains of `ops` (one warm-up
    chain first: it compiles the kernel)."""
    step = step_for(kind)
    x = mx.zeros((1, WIDTH), dtype=mx.bfloat16)
    extra = [mx.zeros((WIDTH,), dtype=mx.bfloat16) for _ in range(EXTRA_INPUTS)]
    mx.eval(x, *extra)
    parts = {"build": [], "submit": [], "wait": []}
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        y = x
        for _ in range(ops):
            y = step(y, extra)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        if rep:
            for name, seconds in (("build", t1 - t0), ("submit", t2 - t1), ("wait", t3 - t2)):
                parts[name].append(seconds * 1e6 / ops)
    return {name: statistics.median(values) for name, values in parts.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=400, help="operations a chain (a one-row decode step: ~400)")
    p.add_argument("--reps", type=int, default=7, help="chains timed a kind, after one warm-up chain")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    p.add_argument("--label", default="", help="a name for this run's line (e.g. its MLX_* settings)")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)} (choose from {', '.join(KINDS)})")
    if args.ops < 1 or args.reps < 1:
        p.error("--ops and --reps must be at least 1")
    if not mx.cuda.is_available():
        skipped = sorted(set(kinds) & KERNEL_KINDS)
        if skipped:
            print(f"no CUDA device: {', '.join(skipped)} skipped")
        kinds = [k for k in kinds if k not in KERNEL_KINDS]
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MLX_"))
    print(f"# {args.label or 'run'} [{settings or 'MLX defaults'}]: us an operation, chains of {args.ops}")
    for kind in kinds:
        t = time_kind(kind, args.ops, args.reps)
        print(f"{kind:14s} build {t['build']:6.2f}  submit {t['submit']:6.2f}  wait {t['wait']:6.2f}")


if __name__ == "__main__":
    main()
