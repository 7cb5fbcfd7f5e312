"""Where a decode step's time goes at B rows, kernel by kernel, under Nsight Compute; and its wall time.

    python3 -m tools.gpu.step_kernels --rows 1,8,9,16,32 --tiers fast,exact --time
    ncu --metrics gpu__time_duration.sum --csv --cache-control none --clock-control none \\
        --profile-from-start off --log-file ncu.csv python3 -m tools.gpu.step_kernels --rows 8,9,16,32 --tiers fast,exact
    python3 -m tools.gpu.step_kernels --summarize ncu.csv

For each tier and row count the model prefills B rows of `--prompt-tokens` (64) in one batch (the batched
caches the continuous batcher runs: a left-padded KV cache per attention layer), warms the decode step,
then evaluates `--steps` decode steps one at a time with a marker kernel after each (its name carries the
tier and rows); the CUDA profiler runs over those steps alone (cuProfilerStart/Stop: ncu's
`--profile-from-start off` then replays neither the prefill nor the warm steps). `--time` instead
times `--steps` pipelined steps (no ncu): the run's wall time a step, and beside it the host's own time a step
(building its graph, submitting it; `host_side`), which must stay below the step for the device to bound it. The
summary reads ncu's CSV: each step's kernels are those between two markers of the same name; per tier and
rows it prints the sum of their durations (the device's busy time, kernels serialized by ncu) and the
kernels that take the most, by name. Set against the wall step time, the sum says whether the device is
busy for the whole step or waits on the host.

`--staged SPEC` (repeatable) runs the rows again with every staged launch (2-64 rows) laid out by SPEC
instead of `staged.staged_config`: `[ROWS:]KEY=VALUE,...` with the keys W (warps), RT (row tiles), CK
(k-tiles a chunk), ST (stages), S (splits; default: as the tree splits K), MINB (blocks an SM), MG (m
groups), RW (1: weights rounded to bf16 before the products, 0: exact integers), KS (every K past it split into
the fewest even parts of at most KS values, in place of `staged.SPLIT_K_VALUES`), NR (row blocks a block
takes in turn, its split's activation rows kept in shared memory; split launches only); ROWS (e.g. `16,32:`) keeps
the variant to those row counts.

    python3 -m tools.gpu.step_kernels --rows 16,64 --time --staged ST=2,MG=2 --staged 64:ST=2,MG=2,MINB=2

`--dense-rows 0,48` runs each tier also with launches of 48 rows and more on dense bf16 copies of the weights
(`quantized_gemv.dense`; the copies made at each install of that tier): the label `fast+dense48`.

`--kernel-cache-dir DIR` compiles the engine's kernels into DIR as `engine serve` does (in parallel, before
the forward that needs them runs; `engine.kernels.kernel_cache`), so new layouts cost seconds, not minutes.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

MARKER = "engine_step_marker"
UNITS_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def profile_marker(label: str):
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=f"{MARKER}_{label}", input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    return lambda x: kernel(
        inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[x.dtype]
    )[0]


def cuda_profiler(on: bool) -> None:
    """cuProfilerStart/Stop (the driver's), where libcuda loads: under ncu --profile-from-start off, the
    kernels between the two are the ones profiled."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    (cuda.cuProfilerStart if on else cuda.cuProfilerStop)()


PREFILL_TOKENS = 8192  # tokens (rows x positions) a prefill forward of `batch_state` takes at most


def batch_state(eng, rows: int, prompt_tokens: int, batch_caches: bool = False):
    """A `rows`-row batch after a prefill of distinct prompts: (the caches, the next tokens [B, 1]). The
    batched caches of the continuous batcher from 2 rows, or at any rows with `batch_caches` (a lone row on
    the continuous lane); a single row's own caches (the serial lane's) otherwise."""
    import mlx.core as mx

    from engine.batch.runner import merge_rows
    from engine.cache import cache_arrays
    from engine.loading import text_config

    batched = rows > 1 or batch_caches
    cache = merge_rows([eng.make_cache() for _ in range(rows)]) if batched else eng.make_cache()
    vocab = min(50000, int(text_config(eng.config)["vocab_size"])) - 10
    prompts = mx.array([[(i * 7919 + r * 104729) % vocab + 10 for i in range(prompt_tokens)] for r in range(rows)])
    # in forwards of at most PREFILL_TOKENS tokens (one forward of 64 x 384 ran out of memory on an 80 GB H100),
    # and the last position's logits only (all of them, rows x prompt x vocab, would not fit either)
    step = max(1, PREFILL_TOKENS // rows)
    for start in range(0, prompt_tokens, step):
        hidden = eng.model.hidden(prompts[:, start : start + step], cache)
        eng.kernels.builds.settle()
        mx.eval(hidden, cache_arrays(cache))
    logits = eng.model.logits(hidden[:, -1:])
    for c in cache:
        if hasattr(c, "finalize"):
            c.finalize()
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    return cache, token


def parse_staged(spec: str) -> tuple[set[int] | None, dict[str, int]]:
    """A `--staged` SPEC as (the row counts it keeps to, or None for all; StagedConfig fields): the syntax of
    ENGINE_STAGED_LAYOUT's items (`engine.kernels.quantized_gemv.layouts.StagedLayout`)."""
    from engine.kernels.quantized_gemv.layouts import StagedLayout

    try:
        layout = StagedLayout.parse(spec)
    except ValueError as e:
        raise SystemExit(f"--staged {spec!r}: {e}") from None
    return (set(layout.rows) if layout.rows else None), dict(layout.fields)


@contextmanager
def staged_layout(fields: dict[str, int]):
    """Every staged launch traced inside laid out by `fields` (splits as the tree chooses unless given)."""
    from engine.kernels.quantized_gemv import calls, staged
    from engine.kernels.quantized_gemv.layouts import StagedLayout, StagedLayouts

    chosen = staged.staged_config
    if fields:
        layouts = StagedLayouts((StagedLayout(None, tuple(sorted(fields.items()))),))
        staged.staged_config = lambda m, k, group_size, bits, _=None, batch=None: chosen(
            m, k, group_size, bits, layouts, batch
        )
        calls._compiled.cache_clear()  # the traced launches hold their layouts
    try:
        yield
    finally:
        staged.staged_config = chosen
        if fields:
            calls._compiled.cache_clear()


@dataclasses.dataclass(frozen=True)
class Cell:
    """One tier, layout and row count: a line of the timings."""

    tier: str
    label: str  # the layout's, "" for the tree's
    fields: tuple[tuple[str, int], ...]
    rows: int

    @property
    def name(self) -> str:
        return f"{self.tier}{self.label}"


def cells_of(tiers: Sequence[str], layouts: Sequence[tuple], rows_list: Sequence[int], min_rows: int) -> list[Cell]:
    """Every (tier, layout, rows) a run times, in the order of one round; a layout skips the rows it does not keep
    and those below the staged kernel's `min_rows`."""
    return [
        Cell(tier, label, tuple(sorted(fields.items())), rows)
        for tier in tiers
        for keep, fields, label in layouts
        for rows in rows_list
        if (keep is None or rows in keep) and (not fields or rows >= min_rows)
    ]


def round_order(cells: Sequence[Cell], r: int) -> list[Cell]:
    """Round r's order: as given in even rounds, reversed in odd ones (A B .. B A), so a drift of the process over
    the run (memory it keeps, clocks) weighs on every cell alike instead of on those timed last."""
    return list(cells) if r % 2 == 0 else list(cells)[::-1]


def summary(times: dict[Cell, list[float]]) -> list[str]:
    """Per cell over the rounds: the median step, its range, and its ratio to the tree's layout at the same tier
    and rows (where timed)."""
    lines = []
    for cell, ts in times.items():
        median = statistics.median(ts)
        base = times.get(dataclasses.replace(cell, label="", fields=()))
        ratio = f"  {median / statistics.median(base):.3f}x the tree's" if base and cell.fields else ""
        lines.append(
            f"{cell.name:6s} rows {cell.rows:3d}: median {median * 1e3:7.2f} ms over {len(ts)} rounds "
            f"({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}){ratio}"
        )
    return lines


def run(
    model_name: str,
    rows_list: list[int],
    tiers: list[str],
    steps: int,
    prompt_tokens: int,
    timed: bool,
    warm: int = 3,
    batch_caches: bool = False,
    off: tuple[str, ...] = (),
    variants: Sequence[str] = (),
    only_staged: bool = False,
    state_dtypes: Sequence[str] = (),
    rounds: int = 1,
    dense_rows: Sequence[int] = (0,),
) -> None:
    import gc

    import mlx.core as mx

    from engine.engine import Engine
    from engine.kernels import KernelConfig, install
    from engine.kernels.quantized_gemv import staged

    layouts = [(None, {}, "")] * (not only_staged) + [
        (*parse_staged(v), f" [{v}]") for v in variants
    ]  # a bad SPEC stops it here

    def config(tier: str) -> KernelConfig:  # `off`: KernelConfig switches turned off (attention_kernels, ...)
        tier, _, dense = tier.partition("+dense")
        tier, _, state_dtype = tier.partition("/")
        switches = {name: False for name in off} | ({"state_dtype": state_dtype} if state_dtype else {})
        if dense:  # the copies made at install, as ENGINE_KEEP_DENSE=1 makes them
            switches |= {"keep_dense": True, "dense_decode_rows": int(dense)}
        return dataclasses.replace(KernelConfig.from_env(tier), **switches)

    tiers = [f"{t}/{d}" if d else t for t in tiers for d in state_dtypes or ("",)]
    tiers = [t + (f"+dense{n}" if n else "") for t in tiers for n in dense_rows]
    eng = Engine.load(model_name, with_tokenizer=False, kernels=config(tiers[0]))
    cells = cells_of(tiers, layouts, rows_list, staged.MIN_ROWS)
    times: dict[Cell, list[float]] = {cell: [] for cell in cells}
    said = set()
    for r in range(rounds):
        if rounds > 1:
            print(f"round {r + 1}/{rounds}", flush=True)
        for cell in round_order(cells, r):
            with staged_layout(dict(cell.fields)):  # new layer steps: compiled ones keep their first trace's launches
                ks = install(eng.model, config(cell.tier), eng.config.get("model_type"))
                if cell.tier not in said:
                    said.add(cell.tier)
                    print(
                        f"{model_name} {cell.tier}: {ks.tier}, {ks.quantized_linears} GEMV layers"
                        + (f", off: {','.join(off)}" if off else "")
                        + (", batch caches" if batch_caches else ""),
                        flush=True,
                    )
                step = step_rows(eng, cell.name, cell.rows, steps, prompt_tokens, timed, warm, batch_caches)
            if step is not None:
                times[cell].append(step)
            gc.collect()  # the cell's caches, and what MLX kept of them, gone before the next one
            mx.clear_cache()
    if rounds > 1 and timed:
        print("\n".join(["# over the rounds:", *summary(times)]), flush=True)


def step_rows(
    eng, label: str, rows: int, steps: int, prompt_tokens: int, timed: bool, warm: int, batch_caches: bool
) -> float | None:
    """One row count's decode steps: timed (pipelined; the wall time a step returned), or one at a time between
    markers for ncu."""
    import mlx.core as mx

    cache, token = batch_state(eng, rows, prompt_tokens, batch_caches)
    for _ in range(warm):  # compiles this shape's kernels
        token = next_token(eng, token, cache)
        eng.kernels.builds.settle()
        mx.eval(token)
    if timed:
        mx.synchronize()
        stamps = []
        for _ in range(steps):
            token = next_token(eng, token, cache)
            mx.async_eval(token)
            stamps.append(time.perf_counter())
        mx.eval(token)
        stamps.append(time.perf_counter())
        # The whole run's time over its steps: the host may run ahead of the device, so the gaps between
        # submissions alone (their median beside it) can show the host's time, not the step's.
        step = (stamps[-1] - stamps[0]) / steps
        gap = statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:-1]))
        build, submit = host_side(eng, token, cache, min(steps, HOST_STEPS))
        print(
            f"{label:6s} rows {rows:3d}: step {step * 1e3:7.2f} ms ({rows / step:7.1f} tok/s; median "
            f"submit gap {gap * 1e3:.2f} ms; host {(build + submit) * 1e3:.2f} ms = build {build * 1e3:.2f} + "
            f"submit {submit * 1e3:.2f}, {(build + submit) / step:.2f}x the step)",
            flush=True,
        )
        return step
    marker = profile_marker(f"{label.split()[0]}_{rows}")
    mx.eval(marker(token.reshape(-1)))
    mx.synchronize()
    cuda_profiler(True)
    mx.eval(marker(token.reshape(-1)))
    for _ in range(steps):
        token = next_token(eng, token, cache)
        mx.eval(token)
        mx.eval(marker(token.reshape(-1)))
    mx.synchronize()
    cuda_profiler(False)
    print(f"{label} rows {rows}: {steps} steps done", flush=True)
    return None


HOST_STEPS = 8  # steps the host side is timed over, after the timed ones


def next_token(eng, token, cache):
    """One greedy decode step's graph (lazy): the model over `token` [B, 1] with `cache`, each row's argmax."""
    import mlx.core as mx

    return mx.argmax(eng.model(token, cache)[:, -1:], axis=-1)


def host_side(eng, token, cache, steps: int) -> tuple[float, float]:
    """The host's own time a decode step, median over `steps` steps each started on an idle device: building the
    step's graph in Python, and submitting it (`mx.async_eval` encodes and launches every kernel; with nothing in
    flight it never waits for the device). Below the pipelined step, the host is not what bounds it."""
    import mlx.core as mx

    builds, submits = [], []
    for _ in range(steps):
        mx.eval(token)
        started = time.perf_counter()
        token = next_token(eng, token, cache)
        built = time.perf_counter()
        mx.async_eval(token)
        builds.append(built - started)
        submits.append(time.perf_counter() - built)
    mx.eval(token)
    return statistics.median(builds), statistics.median(submits)


def summarize(path: str, top: int) -> None:
    rows = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            scale = UNITS_US.get(row["Metric Unit"], float("nan"))
            rows.append((row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale))
    marks = [(i, name.split("(")[0]) for i, (name, _) in enumerate(rows) if MARKER in name]
    sections = defaultdict(list)  # marker name: the steps between two of its markers
    for (a, name_a), (b, name_b) in zip(marks, marks[1:]):
        if name_a == name_b:
            sections[name_a].append(rows[a + 1 : b])
    if not sections:
        raise SystemExit(f"{path}: {len(marks)} markers among {len(rows)} kernels; nothing between two markers")
    for label, steps in sections.items():
        per_step = [sum(us for _, us in step) for step in steps]
        by_name = defaultdict(list)
        for step in steps:
            for name, us in step:
                by_name[name.split("(")[0][:80]].append(us)
        n = len(steps)
        print(
            f"\n{label.removeprefix(MARKER + '_')}: {n} steps, {len(steps[0])} kernels a step; device busy "
            f"{statistics.median(per_step) / 1e3:.2f} ms a step (median; {min(per_step) / 1e3:.2f}-"
            f"{max(per_step) / 1e3:.2f})"
        )
        print(f"{'kernel':80s} {'a step':>7s} {'us a step':>10s} {'share':>6s} {'us each':>9s} {'min':>7s} {'max':>7s}")
        total = statistics.median(per_step)
        for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(
                f"{name:80s} {len(times) / n:7.1f} {sum(times) / n:10.1f} {sum(times) / n / total:6.1%} "
                f"{statistics.median(times):9.1f} {min(times):7.1f} {max(times):7.1f}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--rows", default="1", help="comma-separated batch rows (default 1)")
    p.add_argument(
        "--tiers",
        default="fast",
        help="comma-separated kernel tiers (the fast tier takes ENGINE_FUSE and ENGINE_GEMV_LAUNCH)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64, help="the context the decode steps attend over")
    p.add_argument(
        "--warm",
        type=int,
        default=3,
        help="steps before the measured ones (default 3; under ncu, which replays every kernel, 1 keeps the run short)",
    )
    p.add_argument("--time", action="store_true", help="time pipelined steps instead of marking them for ncu")
    p.add_argument(
        "--batch-caches",
        action="store_true",
        help="the continuous batcher's caches at one row too (a lone row on the continuous lane)",
    )
    p.add_argument(
        "--off",
        default="",
        help="KernelConfig switches to turn off, comma-separated (delta_step_kernel, "
        "attention_step, attention_kernels)",
    )
    p.add_argument(
        "--staged",
        action="append",
        default=[],
        metavar="SPEC",
        help="also run the rows with the staged launches laid out by SPEC (see above); repeatable",
    )
    p.add_argument("--only-staged", action="store_true", help="run the --staged layouts only, not the tree's")
    p.add_argument(
        "--state-dtype",
        default="",
        help="the fast tier's DeltaNet state dtypes to run each tier with, comma-separated (float32, bfloat16, "
        "float16; default the fast tier's, unnamed in the output)",
    )
    p.add_argument(
        "--dense-rows",
        default="0",
        help="dense decode rows to run each tier with, comma-separated (ENGINE_DENSE_DECODE_ROWS; 0: off; others keep "
        "dense copies of the weights, 2 bytes a weight more memory; e.g. 0,48)",
    )
    p.add_argument(
        "--kernel-cache-dir",
        type=Path,
        help="compile the engine's kernels into DIR ahead of MLX, in parallel (MLX_PTX_CACHE_DIR)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --time: time every tier, layout and row count this many times, the order reversed every other "
        "round, then each one's median and its ratio to the tree's layout (default 1)",
    )
    p.add_argument("--summarize", metavar="NCU_CSV", help="read ncu's CSV instead of running the model")
    p.add_argument("--top", type=int, default=25, help="kernels to list, most time first")
    args = p.parse_args()
    if args.rounds < 1 or (args.rounds > 1 and not args.time):
        p.error("--rounds takes a count of at least 1, and more than 1 only with --time")
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        if args.kernel_cache_dir:
            from engine.cli import enable_kernel_cache

            enable_kernel_cache(args.kernel_cache_dir)  # before MLX compiles anything
        off = tuple(filter(None, (v.strip() for v in args.off.split(","))))
        run(
            args.model,
            [int(r) for r in args.rows.split(",")],
            args.tiers.split(","),
            args.steps,
            args.prompt_tokens,
            args.time,
            args.warm,
            args.batch_caches,
            off,
            args.staged,
            args.only_staged,
            [d for d in args.state_dtype.split(",") if d],
            args.rounds,
            [int(v) for v in args.dense_rows.split(",")],
        )


if __name__ == "__main__":
    main()
