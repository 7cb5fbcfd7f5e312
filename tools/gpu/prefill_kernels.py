"""Where a prefill forward's time goes, by group and chunk shape: wall time, and kernels under Nsight Compute.

    python3 -m tools.gpu.prefill_kernels --shapes 1x1024,1x256,32x64,64x32 --chunks 2
    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none \\
        --profile-from-start off --log-file ncu.csv python3 -m tools.gpu.prefill_kernels --shapes 32x64 --ncu
    python3 -m tools.gpu.step_kernels --summarize ncu.csv

A shape GxL is a prefill group of G prompts taking L-token chunks, as the continuous batcher runs it (the
batched caches, one forward of [G, L] a chunk); `--chunks` chunks follow each other on the same caches (a
prompt longer than `engine serve --prefill-chunk`, 2048 by default, is such chunks). Each shape is compiled by
one untimed pass, then timed `--reps` times on fresh caches: the wall time of each chunk's forward to its
evaluated caches (`--clear`: MLX's buffer cache emptied after each chunk, as mlx-lm's and the batcher's prefill
do; `--interleave`: the shapes in turn, as a server's iterations mix them). `--ncu` instead runs one pass
between markers (`prefill_GxL`) for `step_kernels --summarize`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from tools.gpu.step_kernels import cuda_profiler, profile_marker


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        g, _, length = item.lower().partition("x")
        if not (g.isdigit() and length.isdigit()) or int(g) < 1 or int(length) < 1:
            raise SystemExit(f"--shapes {item!r}: give GROUPxCHUNK, e.g. 32x64")
        out.append((int(g), int(length)))
    return out


def one_pass(eng, group: int, length: int, chunks: int, clear: bool = False) -> list[float]:
    """`chunks` forwards of [group, length] on fresh batched caches: each one's wall seconds to its caches
    (`clear`: MLX's buffer cache emptied after each, as mlx-lm's prefill does)."""
    import mlx.core as mx

    from engine.batch.runner import merge_rows
    from engine.cache import cache_arrays
    from engine.loading import text_config

    vocab = min(50000, int(text_config(eng.config)["vocab_size"])) - 10

    cache = merge_rows([eng.make_cache() for _ in range(group)])
    times = []
    for c in range(chunks):
        tokens = mx.array(
            [[(i * 7919 + r * 104729 + c * 31) % vocab + 10 for i in range(length)] for r in range(group)]
        )
        mx.eval(tokens)
        t0 = time.perf_counter()
        eng.model(tokens, cache=cache)
        mx.eval(cache_arrays(cache))
        times.append(time.perf_counter() - t0)
        if clear:
            mx.clear_cache()
    return times


def run(
    model_name: str,
    shapes: list[tuple[int, int]],
    chunks: int,
    reps: int,
    ncu: bool,
    tier: str,
    clear: bool = False,
    interleave: bool = False,
    dense_min_rows: int | None = None,
    cache_limit: int | None = None,
    model_path: str | None = None,
) -> None:
    import mlx.core as mx

    from engine.engine import Engine
    from engine.kernels import KernelConfig

    kernels = KernelConfig.from_env(tier)
    if dense_min_rows is not None:
        kernels = dataclasses.replace(kernels, dense_min_rows=dense_min_rows)
    if cache_limit is not None:
        mx.set_cache_limit(cache_limit)
    eng = Engine.load(None if model_path else model_name, model_path, with_tokenizer=False, kernels=kernels)
    print(
        f"{model_path or model_name} {tier}: prefill forwards, {chunks} chunk(s) a pass, dense prefill from "
        f"{kernels.dense_min_rows} rows"
        + (", MLX's buffer cache emptied after each" if clear else "")
        + (", the shapes in turn" if interleave else "")
        + (f", MLX's cache limit {cache_limit} bytes" if cache_limit is not None else ""),
        flush=True,
    )
    for group, length in shapes:
        one_pass(eng, group, length, chunks)  # compiles this shape
        mx.clear_cache()
        if ncu:
            marker = profile_marker(f"prefill_{group}x{length}")
            token = mx.zeros((1,), dtype=mx.int32)
            mx.eval(marker(token))
            mx.synchronize()
            cuda_profiler(True)
            mx.eval(marker(token))
            one_pass(eng, group, length, 1)
            mx.eval(marker(token))
            mx.synchronize()
            cuda_profiler(False)
            print(f"prefill {group}x{length}: marked", flush=True)
        elif not interleave:
            report(group, length, [one_pass(eng, group, length, chunks, clear) for _ in range(reps)])
            mx.clear_cache()
    if interleave and not ncu:
        passes = {shape: [] for shape in shapes}
        for _ in range(reps):
            for group, length in shapes:
                passes[(group, length)].append(one_pass(eng, group, length, chunks, clear))
        for (group, length), timed in passes.items():
            report(group, length, timed)


def report(group: int, length: int, passes: list[list[float]]) -> None:
    for c in range(len(passes[0])):
        times = [p[c] * 1e3 for p in passes]
        ms = statistics.median(times)
        print(
            f"prefill {group:3d}x{length:<5d} chunk {c + 1}: {ms:8.1f} ms ({group * length / ms * 1e3:8.0f} tok/s; "
            f"{min(times):.1f}-{max(times):.1f})",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--model-path", help="a model directory instead of a registry name")
    p.add_argument("--shapes", default="1x1024,1x256,32x64,64x32", help="comma-separated GROUPxCHUNK")
    p.add_argument("--chunks", type=int, default=2, help="chunks a pass, one after another on the same caches")
    p.add_argument("--reps", type=int, default=3, help="timed passes a shape (median)")
    p.add_argument("--tier", default="fast", help="kernel tier (fast, exact, auto)")
    p.add_argument("--clear", action="store_true", help="empty MLX's buffer cache after each chunk (mx.clear_cache)")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="time the shapes in turn (each pass after another shape's) instead of all passes of a shape together",
    )
    p.add_argument(
        "--dense-min-rows",
        type=int,
        help="rows from which a prefill dequantizes and runs one GEMM "
        "(KernelConfig.dense_min_rows; default the tree's)",
    )
    p.add_argument(
        "--cache-limit",
        type=int,
        help="MLX's buffer cache limit in bytes (engine serve sets 16 GiB on CUDA); default MLX's",
    )
    p.add_argument("--ncu", action="store_true", help="one marked pass a shape (one chunk) for ncu instead of timing")
    args = p.parse_args()
    run(
        args.model,
        parse_shapes(args.shapes),
        max(1, args.chunks),
        max(1, args.reps),
        args.ncu,
        args.tier,
        args.clear,
        args.interleave,
        args.dense_min_rows,
        args.cache_limit,
        args.model_path,
    )


if __name__ == "__main__":
    main()
