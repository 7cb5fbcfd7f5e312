"""A prompt chunk's causal attention on a model's heads: MLX's `scaled_dot_product_attention` (on CUDA, for more
than one query, products and a softmax over the whole scores) against `engine.kernels.attention_prefill`.

    python3 -m tools.gpu.attention_prefill_speed [--model qwen27b] [--shapes 2048x2048,2048x16384] [--calls 4]

Each shape is QUERIESxKEYS (the chunk's queries sit at the last positions of the keys, as a later chunk of a long
prompt does). For each, one layer's median time each way, timed as `harness kernels` times (calls built before the
clock), the kernel's TFLOP/s (the causal products' multiply-adds, twice), and how far each is from float32
attention on the first query rows (computed on the CPU). Lines go to stdout; with $OUT set, the rows to
$OUT/attention-prefill-speed.json.
"""

from __future__ import annotations

import argparse
import math

import mlx.core as mx

from engine.device import device_label
from engine.kernels import on_cuda
from engine.kernels.attention_prefill import prefill_attention
from engine.registry import get_spec
from harness.kernels.bench import time_us
from harness.kernels.bench_config import BenchConfig
from tools.gpu.results import save_json

CHECKED_ROWS = 128  # query rows compared with float32 attention (the CPU's share of the work)


def causal_flops(queries: int, keys: int, heads: int, dim: int) -> float:
    """Floating-point operations of the two products over the keys each query sees."""
    seen = sum(keys - queries + i + 1 for i in range(queries))
    return 4.0 * seen * heads * dim


def float32_rows(q: mx.array, k: mx.array, v: mx.array, scale: float, rows: int) -> mx.array:
    """Float32 causal attention of the first `rows` queries, on the CPU."""
    with mx.stream(mx.cpu):
        length, keys = q.shape[2], k.shape[2]
        rows = min(rows, length)
        q, k, v = (mx.array(x).astype(mx.float32) for x in (q[:, :, :rows], k, v))
        reps = q.shape[1] // k.shape[1]
        k, v = mx.repeat(k, reps, 1), mx.repeat(v, reps, 1)
        scores = (q @ k.swapaxes(-1, -2)) * scale
        allowed = mx.arange(keys)[None] <= mx.arange(keys - length, keys - length + rows)[:, None]
        return mx.softmax(mx.where(allowed, scores, -math.inf), axis=-1) @ v


def row(queries: int, keys: int, model: str, cfg: BenchConfig) -> dict:
    g = get_spec(model).geometry
    hq, hkv, d = g.num_attention_heads, g.num_key_value_heads, g.head_dim
    mx.random.seed(queries + keys)
    q = mx.random.normal((1, hq, queries, d)).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, hkv, keys, d)).astype(mx.bfloat16) for _ in range(2))
    mx.eval(q, k, v)
    scale = d**-0.5
    out = {"queries": queries, "keys": keys, "heads": f"{hq}/{hkv}x{d}"}
    mlx_call = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")  # noqa: E731
    out["mlx_us"] = time_us(mlx_call, cfg)
    want = float32_rows(q, k, v, scale, CHECKED_ROWS)
    out["mlx_err"] = mx.abs(mlx_call()[:, :, :CHECKED_ROWS].astype(mx.float32) - want).max().item()
    if on_cuda():
        kernel_call = lambda: prefill_attention(q, k, v, scale)  # noqa: E731
        out["kernel_us"] = time_us(kernel_call, cfg)
        out["kernel_tflops"] = causal_flops(queries, keys, hq, d) / out["kernel_us"] / 1e6
        out["kernel_err"] = mx.abs(kernel_call()[:, :, :CHECKED_ROWS].astype(mx.float32) - want).max().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen27b")
    ap.add_argument(
        "--shapes", default="1024x1024,2048x2048,2048x4096,2048x16384", help="QUERIESxKEYS, comma-separated"
    )
    ap.add_argument("--calls", type=int, default=4, help="layers an evaluation")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = BenchConfig(calls=args.calls, repeats=args.repeats, warmup=1)
    print(f"{args.model}: prompt attention a layer, {device_label()}")
    rows = []
    for shape in args.shapes.split(","):
        queries, keys = (int(x) for x in shape.split("x"))
        r = row(queries, keys, args.model, cfg)
        rows.append(r)
        line = f"{queries:>6} queries x {keys:>6} keys: MLX {r['mlx_us']:10.1f} us (|err| {r['mlx_err']:.1e})"
        if "kernel_us" in r:
            line += (
                f"; kernel {r['kernel_us']:10.1f} us, {r['kernel_tflops']:.0f} TFLOP/s (|err| {r['kernel_err']:.1e})"
            )
        print(line, flush=True)
    save_json("attention-prefill-speed.json", {"model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
