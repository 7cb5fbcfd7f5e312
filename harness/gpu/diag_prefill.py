"""Where a 1K-token prefill goes, and whether dequantizing to bf16 and one GEMM beats MLX's quantized
matmul for prompt chunks.

1. Per linear shape of the model at M = prompt rows: MLX's quantized matmul, `dense_matmul` (dequantize,
   then one GEMM), and the GEMM alone on weights dequantized beforehand; totals weighted by how many
   layers have each shape. An M sweep on the largest shape places `DENSE_MIN_ROWS`.
2. Whole model: time to first token of a prompt, exact tier / fast tier with MLX's quantized matmul / fast
   tier with `dense_matmul`, alternating twice (the machine drifts).

    source .device-kit/b/env.sh && python3 harness/gpu/diag_prefill.py [--model qwen27b] [--tokens 1024]
Lines go to stdout, the rows to $OUT/prefill-<model>.json.
"""

import argparse
import statistics
import time

import mlx.core as mx

from engine.engine import Engine
from engine.kernels import EXACT, FAST, install, quantized_gemv
from engine.kernels.quantized_gemv import dense_matmul
from engine.registry import get_spec
from harness.gpu.results import save_json
from harness.kernel_bench import BenchConfig, linear_shapes, random_quantized, time_us, weight_copies


def shape_times(n: int, k: int, m: int, cfg: BenchConfig) -> dict:
    w, scales, biases = random_quantized(n, k, 4, 64)
    dense = mx.dequantize(w, scales, biases, group_size=64, bits=4)
    x = (mx.random.normal((m, k)) * 0.5).astype(mx.bfloat16)
    mx.eval(x, dense)
    weights = weight_copies(w, scales, biases, cfg)

    def qmm():
        return mx.quantized_matmul(x, *weights(), transpose=True, group_size=64, bits=4)

    def dequant_gemm():
        return dense_matmul(x, *weights(), 64, 4)

    def gemm_only():
        return x @ dense.T

    row = {"n": n, "k": k, "m": m}
    for label, fn in (("qmm", qmm), ("dequant_gemm", dequant_gemm), ("gemm_only", gemm_only)):
        row[label] = time_us(fn, cfg)
    row["tflops_dequant_gemm"] = 2 * n * k * m / row["dequant_gemm"] / 1e6
    row["max_rel_diff"] = (mx.abs(qmm() - dequant_gemm()).max() / mx.abs(qmm()).max()).item()
    return row


def ttft_ms(eng: Engine, prompt: list) -> float:
    start = time.perf_counter()
    next(iter(eng.generate(prompt, max_tokens=1, ignore_eos=True)))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--skip-shapes", action="store_true")
    args = p.parse_args()
    m = args.tokens - 1  # the prefill's rows: the last prompt token runs in the first decode step
    results: dict = {"tokens": args.tokens}
    if not args.skip_shapes:
        cfg = BenchConfig(calls=4, repeats=5, warmup=1)
        shapes = linear_shapes(get_spec(args.model))
        rows = []
        for (n, k), count in sorted(shapes.items(), key=lambda item: -item[0][0] * item[0][1]):
            if n > 100_000:
                continue  # the head: a prefill runs it on the last position only
            r = shape_times(n, k, m, cfg) | {"layers": count}
            rows.append(r)
            print(f"{n}x{k} x{count} M={m}: qmm {r['qmm']:.0f} us | dequant+gemm {r['dequant_gemm']:.0f} "
                  f"({r['tflops_dequant_gemm']:.0f} TFLOP/s) | gemm alone {r['gemm_only']:.0f} | "
                  f"rel diff {r['max_rel_diff']:.1e}", flush=True)
        for label in ("qmm", "dequant_gemm", "gemm_only"):
            total = sum(r[label] * r["layers"] for r in rows) / 1e3
            results[f"total_{label}_ms"] = total
            print(f"all linear layers, {label}: {total:.1f} ms", flush=True)
        n, k = rows[0]["n"], rows[0]["k"]
        sweep = [shape_times(n, k, rows_m, cfg) for rows_m in (16, 32, 64, 128, 256, 512)]
        for r in sweep:
            print(f"sweep {n}x{k} M={r['m']}: qmm {r['qmm']:.0f} us | dequant+gemm {r['dequant_gemm']:.0f}", flush=True)
        results["shapes"], results["sweep"] = rows, sweep
        save_json(f"prefill-{args.model}.json", results)

    eng = Engine.load(args.model, with_tokenizer=False)
    prompt = [(i * 7919) % 50000 + 10 for i in range(args.tokens)]
    configs = {"exact": (EXACT, None), "fast_qmm": (FAST, None), "fast_dense": (FAST, 1)}
    ttft: dict = {name: [] for name in configs}
    for round_ in range(3):  # the first round warms each configuration's kernels and is dropped
        for name, (tier, dense_rows) in configs.items():
            quantized_gemv.DENSE_MIN_ROWS = dense_rows
            install(eng.model, tier)
            ms = ttft_ms(eng, prompt)
            if round_:
                ttft[name].append(ms)
            print(f"{args.model} {name}: TTFT {ms:.0f} ms ({args.tokens} tokens){'' if round_ else ', warm-up'}",
                  flush=True)
    results["ttft_ms"] = {name: statistics.median(v) for name, v in ttft.items()}
    results["ttft_samples_ms"] = ttft
    save_json(f"prefill-{args.model}.json", results)


if __name__ == "__main__":
    main()
