"""MLX's cache-thrashing check on its CUDA graph cache, with the check on and off (`engine serve` turns it off).

    python3 -m tools.gpu.cache_thrashing [--cache-size 2] [--topologies 15]

MLX's CUDA backend keys its cached graph executables by their topology and counts every miss over the process's
life; with MLX_ENABLE_CACHE_THRASHING_CHECK on (MLX's default) the miss after twice MLX_CUDA_GRAPH_CACHE_SIZE
raises. Each child process here evaluates `--topologies` chains of 1, 2, ... additions (a new graph topology each)
under a graph cache of `--cache-size` entries, once with the check on and once off, and prints how each ended.
Off CUDA (no graphs) both run through.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHAINS = """
import mlx.core as mx
a = mx.ones((64, 64))
for n in range(1, {topologies} + 1):
    x = a
    for _ in range(n):
        x = x + 1
    mx.eval(x)
print("ran {topologies} topologies")
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-size", type=int, default=2, help="MLX_CUDA_GRAPH_CACHE_SIZE in the children")
    p.add_argument("--topologies", type=int, default=15, help="graph topologies each child evaluates")
    args = p.parse_args(argv)
    for check in ("1", "0"):
        env = dict(os.environ, MLX_CUDA_GRAPH_CACHE_SIZE=str(args.cache_size), MLX_ENABLE_CACHE_THRASHING_CHECK=check)
        code = CHAINS.format(topologies=args.topologies)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        last = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["(no output)"]
        print(f"MLX_ENABLE_CACHE_THRASHING_CHECK={check}: exit {r.returncode}: {last[0]}", flush=True)


if __name__ == "__main__":
    main()
