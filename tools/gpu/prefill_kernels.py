r"""Where a prefill forward's time goes, by group and chunk shape: wall time, and kernels under Nsight Compute.

    python3 -m tools.gpu.prefill_kernels --shapes 1x1024,1x256,32x64,64x32 --chunks 2
    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none \
        --profile-from-start off --log-file ncu.csv python3 -m tools.gpu.prefill_kernels --shapes 32x64 --ncu
    python3 -m tools.gpu.step_kernels --summarize ncu.csv

A shape GxL is a prefill group of G prompts taking L-token chunks, as the continuous batcher runs it (the
batched caches, one forward of [G, L] a chunk); `--chunks` chunks follow each other on the same caches (a
prompt longer than `engine serve --prefill-chunk`, 2048 by default, is such chunks). Each shape is compiled by
one untimed pass, then timed `--reps` times on fresh caches: the wall time of each chunk's forward to its
evaluated caches (`--clear`: MLX's buffer cache emptied after each chunk, as mlx-lm's and the batcher's prefill
do; `--interleave`: the shapes in turn, as a server's iterations mix them). `--ncu` instead runs one pass
between markers (`prefill_GxL`) for `step_kernels --summarize`.

`--arms` compares kernel settings in one process instead of one process each: every ';'-separated arm is
the process's environment plus its NAME=VALUE settings (the project's variables, `engine/env.py`),
installed in turn on the same weights, the order reversed every other pass, each arm's shapes compiled by an
untimed pass after its install; then each arm's medians and its ratio to the first arm (the median of the
passes' ratios):

    python3 -m tools.gpu.prefill_kernels --shapes 1x1024,1x4096 --chunks 1 --reps 3 \
        --arms "ENGINE_PREFILL_ATTENTION_KERNEL=0;ENGINE_PREFILL_ATTENTION_KERNEL=1"
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tools.gpu.step_kernels import cuda_profiler, profile_marker


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        g, _, length = item.lower().partition("x")
        if not (g.isdigit() and length.isdigit()) or int(g) < 1 or int(length) < 1:
            raise SystemExit(f"--shapes {item!r}: give GROUPxCHUNK, e.g. 32x64")
        out.append((int(g), int(length)))
    return out


@dataclass(frozen=True)
class Arm:
    """Kernel settings to time: the text that names them (`--arms`) and the environment they add."""

    label: str
    settings: tuple[tuple[str, str], ...] = ()

    def config(self, tier: str, environ: Mapping[str, str] = os.environ):
        """The KernelConfig of `tier` under `environ` plus this arm's settings; ValueError for a bad value."""
        from engine.kernels import KernelConfig

        return KernelConfig.from_env(tier, {**environ, **dict(self.settings)})


def parse_arms(text: str, tier: str) -> list[Arm]:
    """'NAME=VALUE NAME=VALUE;NAME=VALUE' -> an Arm an item (an empty item: the process's environment alone),
    each checked against `KernelConfig.from_env`: a name the project does not read or a value it refuses stops here."""
    from engine import env

    arms = []
    for item in (v.strip() for v in text.split(";")):
        pairs = [pair.partition("=") for pair in item.split()]
        for name, sep, value in pairs:
            if not sep or not env.known(name):
                raise SystemExit(
                    f"--arms {item!r}: give NAME=VALUE settings of the project's environment variables "
                    "(engine/env.py), e.g. ENGINE_CHUNK_PREPARE_KERNEL=1"
                )
        arm = Arm(item or "(environment)", tuple((name, value) for name, _, value in pairs))
        try:
            arm.config(tier)
        except ValueError as e:
            raise SystemExit(f"--arms {item!r}: {e}") from None
        arms.append(arm)
    if len(arms) < 2:
        raise SystemExit("--arms: give two arms or more, ';'-separated")
    return arms


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
    arms: list[Arm] | None = None,
) -> None:
    import mlx.core as mx

    from engine.engine import Engine

    def config(arm: Arm):
        kernels = arm.config(tier)
        return kernels if dense_min_rows is None else dataclasses.replace(kernels, dense_min_rows=dense_min_rows)

    kernels = config(arms[0] if arms else Arm(""))
    if cache_limit is not None:
        mx.set_cache_limit(cache_limit)
    eng = Engine.load(None if model_path else model_name, model_path, with_tokenizer=False, kernels=kernels)
    if arms:
        print(
            f"{model_path or model_name} {tier}: prefill forwards, {chunks} chunk(s) a pass, {len(arms)} arms in turn",
            flush=True,
        )
        run_arms(eng, arms, config, shapes, chunks, reps, clear)
        return
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


def run_arms(eng, arms: list[Arm], config, shapes: list[tuple[int, int]], chunks: int, reps: int, clear: bool) -> None:
    """Each arm's KernelConfig (`config(arm)`) installed in turn, `reps` times, the order reversed every other time:
    each install's shapes compiled by an untimed pass, then timed once; each arm's medians, then its paired ratios
    to the first arm's."""
    import gc

    import mlx.core as mx

    from engine.kernels import install

    passes = {(a, shape): [] for a in range(len(arms)) for shape in shapes}
    for r in range(reps):
        for a in range(len(arms))[:: 1 if r % 2 == 0 else -1]:
            ks = install(eng.model, config(arms[a]), eng.config.get("model_type"))
            if r == 0:
                print(
                    f"arm {a + 1} ({arms[a].label}): {ks.tier} tier, {ks.dense_prefill_linears} dense prefill "
                    f"layers, {ks.chunked_delta_layers} chunked DeltaNet layers, {ks.prefill_attention_layers} "
                    "with the prompt attention kernel",
                    flush=True,
                )
            for shape in shapes:
                one_pass(eng, *shape, chunks)  # this install's compilations
                mx.clear_cache()
                passes[(a, shape)].append(one_pass(eng, *shape, chunks, clear))
                mx.clear_cache()
            gc.collect()  # the install's replaced modules and their dense copies gone before the next one
    for a, arm in enumerate(arms):
        print(f"arm {a + 1} ({arm.label}):", flush=True)
        for shape in shapes:
            report(*shape, passes[(a, shape)])
    for a in range(1, len(arms)):
        for shape in shapes:
            for c in range(chunks):
                ratios = [p[c] / b[c] for p, b in zip(passes[(a, shape)], passes[(0, shape)])]
                print(
                    f"arm {a + 1} / arm 1: prefill {shape[0]}x{shape[1]} chunk {c + 1}: "
                    f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})",
                    flush=True,
                )


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
    p.add_argument(
        "--arms",
        help="kernel settings to compare in this process, ';'-separated arms of space-separated NAME=VALUE "
        "environment settings (e.g. 'ENGINE_CHUNK_PREPARE_KERNEL=0;ENGINE_CHUNK_PREPARE_KERNEL=1'); "
        "the arms' passes alternate",
    )
    args = p.parse_args()
    if args.arms is not None and (args.ncu or args.interleave):
        p.error("--arms times each arm's shapes in turn: not with --ncu or --interleave")
    arms = parse_arms(args.arms, args.tier) if args.arms is not None else None
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
        arms,
    )


if __name__ == "__main__":
    main()
