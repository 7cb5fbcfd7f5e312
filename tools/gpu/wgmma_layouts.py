"""Which reading of the warpgroup-MMA parts' activation layout the GPU takes: the products with the descriptor's
leading and stride byte offsets as written (K: 16 bytes a column, N: 128) and swapped, each against the rounded
function.

    python3 -m tools.gpu.wgmma_layouts [--rows 64] [--shape 4096x5120]

Prints each reading's largest difference from the reference and whether it is inside the CUDA test's bound. With
`--probe`, also single activations: x all zero but x[m0, k0] = 1, so each output row that is not zero should be row
m0 and equal W[:, k0] (the rounded weights); each line names the rows that are not zero and the column of W each
matches best, which tells a wrong reading of the fragments (k), of the stored sums (rows, n) or of the layout apart.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from engine.kernels.quantized_gemv.staged import splits
from engine.kernels.quantized_gemv.wgmma import KC, SBO, columns, lbo, wgmma_parts
from harness.kernels.bench import random_quantized, rounded_reference, rounding_bound


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="activation rows (at most 64)")
    p.add_argument("--shape", default="4096x5120", help="NxK of the 4-bit, group-64 matrix")
    p.add_argument("--probe", action="store_true", help="also single activations against a 256x1024 matrix")
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
        inside = mx.all(diff <= rounding_bound(want)).item()
        print(
            f"LBO {offsets[0]} SBO {offsets[1]}: max |diff| {diff.max().item():.3e}, inside the bound: {inside}",
            flush=True,
        )

    if args.probe:
        for offsets in ((leading, SBO), (SBO, leading)):
            probe(args.rows, offsets)


def probe(rows: int, offsets: tuple[int, int], n: int = 256, k: int = 1024) -> None:
    w, scales, biases = random_quantized(n, k, 4, 64)
    wt = rounded_reference(mx.eye(k, dtype=mx.bfloat16), w, scales, biases, 64, 4)  # row j: W[:, j]
    print(f"probe, LBO {offsets[0]} SBO {offsets[1]}:", flush=True)
    for m0, k0 in ((0, 0), (1, 0), (2, 0), (8, 0), (0, 1), (0, 2), (0, 8), (0, 16), (0, 100), (rows - 1, k - 1)):
        if m0 >= rows:
            continue
        x = mx.zeros((rows, k), dtype=mx.bfloat16)
        x[m0, k0] = 1.0
        out = wgmma_parts(x, [(w, scales, biases)], 1, offsets=offsets).sum(axis=0)
        live = [r for r in range(rows) if mx.any((out[r] != 0) | mx.isnan(out[r])).item()]  # NaN: read unwritten
        found = []
        for r in live[:3]:
            diffs = mx.abs(wt - out[r][None]).max(axis=1)
            j = mx.argmin(diffs).item()
            same_values = mx.array_equal(mx.sort(out[r]), mx.sort(wt[k0])).item()
            found.append(f"row {r} = W[:, {j}] (max diff {diffs[j].item():.1e}; W[:, {k0}]'s values: {same_values})")
        print(f"  x[{m0}, {k0}] = 1: {len(live)} rows not zero; " + ("; ".join(found) or "all zero"), flush=True)


if __name__ == "__main__":
    main()
