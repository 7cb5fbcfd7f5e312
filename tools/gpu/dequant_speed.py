"""MLX's dequantization against the engine's kernel (`engine.kernels.dequantize`) on a model's matrices.

    python3 -m tools.gpu.dequant_speed [--model qwen27b] [--calls 4] [--repeats 7]

For each distinct [N, K] of the model's linear layers (random weights, the model's bits and group size), the
median time a dequantization of the whole matrix takes with each (calls built before the clock, as
`harness kernels` times), their traffic (packed weights, scales and biases read, values written) in GB/s, and
whether the two give the same values bit for bit. The model total weighs each shape by how many layers have it:
what one dense prompt chunk of the fast tier spends dequantizing. Off CUDA the kernel's side is not timed.
Lines go to stdout; with $OUT set, the rows to $OUT/dequant-speed.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import mlx.core as mx

from engine.device import device_label
from engine.kernels import on_cuda
from engine.kernels.dequantize import dequantize_kernel, kernel_refusal
from engine.registry import get_spec
from harness.kernels.bench import linear_shapes, random_quantized, time_us
from harness.kernels.bench_config import BenchConfig
from tools.gpu.results import save_json


def row(n: int, k: int, layers: int, bits: int, group_size: int, cfg: BenchConfig) -> dict:
    w, s, b = random_quantized(n, k, bits, group_size)
    moved = w.nbytes + s.nbytes + b.nbytes + n * k * s.itemsize
    out = {"n": n, "k": k, "layers": layers, "mb_moved": moved / 1e6}
    out["mlx_us"] = time_us(lambda: mx.dequantize(w, s, b, group_size=group_size, bits=bits), cfg)
    why = kernel_refusal(w, s, group_size, bits) or (None if on_cuda() else "needs MLX's CUDA backend")
    if why:
        return {**out, "kernel_us": None, "note": why}
    out["kernel_us"] = time_us(lambda: dequantize_kernel(w, s, b, group_size, bits), cfg)
    same = mx.array_equal(dequantize_kernel(w, s, b, group_size, bits), mx.dequantize(w, s, b, group_size, bits))
    return {**out, "bit_equal": bool(same.item())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen27b", help="registry model whose shapes to use (default qwen27b)")
    p.add_argument("--calls", type=int, default=4, help="dequantizations an evaluation (default 4)")
    p.add_argument("--repeats", type=int, default=7, help="timed evaluations, median (default 7)")
    args = p.parse_args()
    spec = get_spec(args.model)
    q = spec.quantization
    if q is None:
        raise SystemExit(f"{args.model} is not quantized")
    cfg = dataclasses.replace(BenchConfig(), calls=args.calls, repeats=args.repeats, warmup=1)
    rows, totals = [], {"mlx_us": 0.0, "kernel_us": 0.0}
    for (n, k), layers in sorted(linear_shapes(spec).items(), key=lambda item: -item[0][0] * item[0][1]):
        r = row(n, k, layers, q.bits, q.group_size, cfg)
        rows.append(r)
        rate = {side: r["mb_moved"] / r[side] * 1e3 for side in totals if r.get(side)}
        for side in totals:
            totals[side] += (r.get(side) or 0.0) * layers
        kernel = f"{r['kernel_us']:.1f} us ({rate['kernel_us']:.0f} GB/s)" if r["kernel_us"] else r["note"]
        print(
            f"{n}x{k} x{layers}: mlx {r['mlx_us']:.1f} us ({rate['mlx_us']:.0f} GB/s), kernel {kernel}"
            + (f", bit-equal {r['bit_equal']}" if "bit_equal" in r else ""),
            flush=True,
        )
    print(
        f"{args.model} all layers: mlx {totals['mlx_us'] / 1e3:.1f} ms, kernel {totals['kernel_us'] / 1e3:.1f} ms"
        f" ({device_label()})"
    )
    if os.environ.get("OUT"):
        save_json("dequant-speed.json", {"model": args.model, "device": device_label(), "rows": rows, **totals})


if __name__ == "__main__":
    main()
