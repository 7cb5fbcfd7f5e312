"""What a speculative verify window costs against a plain decode step, at B rows, in one process, and which path
each DeltaNet layer took for it.

    python3 -m tools.gpu.window_cost --model qwen27b --rows 1,8 --widths 2,4 --reps 8

For each row count the model prefills B rows of `--prompt-tokens` (the continuous batcher's batched caches,
`tools.gpu.step_kernels.batch_state`), then times, in turn and `--reps` times each (medians):

    step         one plain [B, 1] decode step, evaluated
    window W     a [B, W] verify window with the recurrent states recorded (as spec rows feed drafts),
                 evaluated; then its rollback (`keep_traced_rows`, `trim_rows`) to one kept token a row,
                 evaluated, timed apart

so the caches grow by one token a measurement whatever it is. Beside each, the paths its DeltaNet layers took
(`gated_delta_decode`'s decode step, verify window, scan, compiled chunk, or the layer's own path). A window of W
tokens that costs more than W plain steps cannot pay, whatever the drafts' acceptance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from contextlib import contextmanager


@contextmanager
def counted_paths(counts: Counter):
    """Count, while inside, which branch of a DeltaNet layer step each forward takes."""
    import engine.kernels.gated_delta_decode as decode

    saved = decode.applies, decode.window_applies, decode.scan_applies

    def spy(name, fn):
        def check(*args, **kwargs):
            taken = fn(*args, **kwargs)
            counts[name] += taken
            return taken

        return check

    decode.applies, decode.window_applies, decode.scan_applies = (
        spy("decode step", saved[0]),
        spy("verify window", saved[1]),
        spy("scan", saved[2]),
    )
    try:
        yield
    finally:
        decode.applies, decode.window_applies, decode.scan_applies = saved


def measure(
    model_name: str, rows_list: list[int], widths: list[int], reps: int, prompt_tokens: int, force: bool = False
) -> None:
    import dataclasses

    import mlx.core as mx

    from engine.cache import BatchKVCache, RecurrentCache, cache_arrays
    from engine.engine import Engine
    from engine.kernels import KernelConfig
    from tools.gpu.step_kernels import batch_state

    kernels = dataclasses.replace(KernelConfig.from_env("fast"), force=force)
    eng = Engine.load(model_name, with_tokenizer=False, kernels=kernels)
    delta_layers = sum(1 for layer in eng.model.layers if getattr(layer, "is_linear", False))
    print(f"{model_name} on the {eng.kernels.tier.value} tier, {delta_layers} DeltaNet layers", flush=True)

    def rollback(cache, rows: int, width: int) -> None:
        for c in cache:
            if isinstance(c, RecurrentCache):
                c.keep_traced_rows([1] * rows)
            elif isinstance(c, BatchKVCache):
                c.trim_rows([width - 1] * rows)
            elif hasattr(c, "trim"):
                c.trim(width - 1)
        mx.eval(cache_arrays(cache))

    for rows in rows_list:
        cache, token = batch_state(eng, rows, prompt_tokens, batch_caches=True)
        times: dict[str, list[float]] = {"step": []}
        undo_times: dict[str, list[float]] = {}
        paths: dict[str, Counter] = {"step": Counter()}
        for w in widths:
            times[f"window {w}"], undo_times[f"window {w}"], paths[f"window {w}"] = [], [], Counter()
        for rep in range(reps + 1):  # the first round compiles and is not kept
            with counted_paths(paths["step"] if rep == 1 else Counter()):
                start = time.perf_counter()
                logits = eng.model(token, cache)
                mx.eval(logits, cache_arrays(cache))
                if rep:
                    times["step"].append(time.perf_counter() - start)
            for w in widths:
                x = mx.concatenate([token] * w, axis=1)
                key = f"window {w}"
                for c in cache:
                    if isinstance(c, RecurrentCache):
                        c.start_trace()
                with counted_paths(paths[key] if rep == 1 else Counter()):
                    start = time.perf_counter()
                    logits = eng.model(x, cache)
                    mx.eval(logits, cache_arrays(cache))
                    forward = time.perf_counter() - start
                start = time.perf_counter()
                rollback(cache, rows, w)
                if rep:
                    times[key].append(forward)
                    undo_times[key].append(time.perf_counter() - start)
        step = statistics.median(times["step"]) * 1e3
        for key, timed in times.items():
            ms = statistics.median(timed) * 1e3
            undo = f", rollback {statistics.median(undo_times[key]) * 1e3:.2f} ms" if key in undo_times else ""
            taken = ", ".join(f"{name} {n}" for name, n in paths[key].items() if n) or "the layers' own path"
            print(
                f"rows {rows:3d} {key:10s} {ms:8.2f} ms ({ms / step:4.2f} steps){undo}; DeltaNet paths: {taken}",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b", help="registry name (synthesized on first use)")
    p.add_argument("--rows", default="1,8", help="row counts, comma-separated")
    p.add_argument("--widths", default="2,4", help="window widths (1 + drafts), comma-separated")
    p.add_argument("--reps", type=int, default=8, help="timed rounds (after one that compiles)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--force", action="store_true", help="the fast tier's paths off CUDA too (for testing)")
    args = p.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if any(w < 2 for w in widths):
        p.error("--widths: a window feeds at least one draft (width 2 or more)")
    rows = [int(r) for r in args.rows.split(",")]
    measure(args.model, rows, widths, max(1, args.reps), args.prompt_tokens, args.force)


if __name__ == "__main__":
    main()
