"""The chunked DeltaNet rule with its chunk-after-chunk states as MLX operations against the CUDA kernel
(`engine.kernels.gated_delta_states`, one and two chunk buffers a block, its products on the tensor cores), and
with its chunk-local part as a CUDA launch too (`engine.kernels.gated_delta_prepare`), on a model's heads.

    python3 -m tools.gpu.chunk_states_speed [--model qwen27b] [--tokens 1024,4096] [--rows 1] [--calls 4]

For each prompt length (and batch rows), the median time of one layer's whole chunked rule
(`chunked_gated_delta`: the chunk-local products, the states, the outputs) each way, timed as `harness kernels`
times (calls built before the clock), and how far each variant's outputs and final state are from the MLX
path's (which runs its float32 products as TF32 on CUDA). Lines go to stdout; with $OUT set, the rows to
$OUT/chunk-states-speed.json.
"""

from __future__ import annotations

import argparse
from functools import partial

import mlx.core as mx

from engine.device import device_label
from engine.kernels import on_cuda
from engine.kernels.gated_delta_chunked import chunked_gated_delta
from engine.kernels.gated_delta_prepare import chunk_prepare
from engine.kernels.gated_delta_states import chunk_states
from engine.registry import get_spec
from harness.kernels.bench import delta_inputs, time_us
from harness.kernels.bench_config import BenchConfig
from tools.gpu.results import save_json


def heads(model: str) -> tuple[int, int, int, int]:
    """(key heads, value heads, key dim, value dim) of the model's DeltaNet layers."""
    g = get_spec(model).geometry
    return g.linear_num_key_heads, g.linear_num_value_heads, g.linear_key_head_dim, g.linear_value_head_dim


def row(tokens: int, rows: int, shape: tuple[int, int, int, int], cfg: BenchConfig) -> dict:
    hk, hv, dk, dv = shape
    q, k, v, g, beta, state = delta_inputs(tokens, hk, hv, dk, dv, dtype=mx.bfloat16, seed=tokens)
    if rows > 1:
        q, k, v, g, beta = (mx.repeat(x, rows, 0) for x in (q, k, v, g, beta))
        state = mx.repeat(state, rows, 0)
    args = (q, k, v, mx.log(g), beta, state.astype(mx.float16))
    mx.eval(args)
    out = {"tokens": tokens, "rows": rows, "heads": f"{hk}/{hv}x{dk}/{dv}"}
    out["mlx_us"] = time_us(lambda: chunked_gated_delta(*args)[0], cfg)
    if not on_cuda():
        return out
    y_ref, s_ref = chunked_gated_delta(*args)
    for name, kernels in VARIANTS.items():
        out[f"{name}_us"] = time_us(lambda: chunked_gated_delta(*args, **kernels)[0], cfg)
        y, s = chunked_gated_delta(*args, **kernels)
        out[f"{name}_y_diff"] = mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item()
        out[f"{name}_state_diff"] = mx.abs(s - s_ref).max().item()
    return out


VARIANTS = {  # the rule's parts as CUDA launches (the JSON's keys: kernel1 and kernel2 as before)
    "kernel1": {"states": partial(chunk_states, stages=1)},
    "kernel2": {"states": partial(chunk_states, stages=2)},
    "mma": {"states": partial(chunk_states, mma=True)},
    "prepare": {"states": chunk_states, "prepare": chunk_prepare},
}
LABELS = {"kernel1": "states ST=1", "kernel2": "states ST=2", "mma": "states MMA", "prepare": "prepare+states"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen27b")
    ap.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--rows", default="1", help="batch rows, comma-separated")
    ap.add_argument("--calls", type=int, default=4, help="layers' rules an evaluation")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = BenchConfig(calls=args.calls, repeats=args.repeats, warmup=1)
    shape = heads(args.model)
    print(f"{args.model}: chunked DeltaNet rule a layer, {device_label()}")
    rows = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        for b in (int(x) for x in args.rows.split(",")):
            r = row(tokens, b, shape, cfg)
            rows.append(r)
            line = f"{b:>3} x {tokens:>6} tokens: MLX loop {r['mlx_us']:9.1f} us"
            for name in VARIANTS:
                if f"{name}_us" in r:
                    line += (
                        f"; {LABELS[name]} {r[f'{name}_us']:9.1f} us"
                        f" (|dy| {r[f'{name}_y_diff']:.1e}, |dS| {r[f'{name}_state_diff']:.1e})"
                    )
            print(line, flush=True)
    save_json("chunk-states-speed.json", {"model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
