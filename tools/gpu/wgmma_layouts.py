"""Which reading of the wgmma prototype's activation layout the GPU takes: the products with the descriptor's
leading and stride byte offsets as written (K 16 bytes a column, N 128) and swapped, each against the rounded function.

    python3 -m tools.gpu.wgmma_layouts [--rows 64] [--shape 4096x5120]

Prints each reading's largest difference from the reference and whether it is inside the CUDA test's bound.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from engine.kernels.quantized_gemv.staged import splits
from engine.kernels.quantized_gemv.wgmma import KC, SBO, columns, lbo, wgmma_parts
from harness.kernels.bench import random_quantized, rounded_reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="activation rows (at most 64)")
    p.add_argument("--shape", default="4096x5120", help="NxK of the 4-bit, group-64 matrix")
    args = p.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    w, scales, biases = random_quantized(n, k, 4, 64)
    x = mx.random.normal((args.rows, k)).astype(mx.bfloat16)
    want = rounded_reference(x, w, scales, biases, 64, 4)
    mx.eval(want)
    leading = lbo(columns(args.rows))
    for offsets in ((leading, SBO), (SBO, leading)):
        got = wgmma_parts(x, [(w, scales, biases)], splits(k, KC), offsets=offsets).sum(axis=0)
        diff = mx.abs(got - want)
        inside = mx.all(diff <= 2.0**-8 * mx.abs(want) + 1e-4 * mx.abs(want).max()).item()
        print(
            f"LBO {offsets[0]} SBO {offsets[1]}: max |diff| {diff.max().item():.3e}, inside the bound: {inside}",
            flush=True,
        )


if __name__ == "__main__":
    main()
