"""`harness batch-bench`: the continuous lane in process, against the serial lane and mlx-lm's BatchGenerator."""

from __future__ import annotations

import json

from harness.cli_common import console, csv_ints, kernels_option, measured_options, model_source, out, targets


def add_batch_bench(sub) -> None:
    bb = sub.add_parser(
        "batch-bench",
        help="scheduler overhead: continuous vs serial lane, and C concurrent requests vs mlx-lm",
        description="In process, on one artifact: (1) one request through the continuous batcher vs the "
        "serial lane (decode tok/s); (2) C requests at once, aggregate output tok/s, ours vs mlx-lm's "
        "BatchGenerator at the same prefill batch size (8, as mlx_lm.server runs it), and the decode step at C "
        "rows (ms, while all C decode) against mlx-lm's and against the one-row step of (1). Sides alternate. "
        "--kernels picks the engine side's kernel tier; mlx-lm stays stock.",
    )
    model_source(bb)
    measured_options(bb, prompt_tokens=128, decode_tokens=128, samples=3, unit="runs per side")
    bb.add_argument("--concurrency", type=csv_ints, default=[4, 8], help="concurrent requests (default 4,8)")
    kernels_option(
        bb,
        "the engine side's kernel tier: exact (ids must match mlx-lm's), fast (CUDA kernels, equal "
        "to rounding; exact off CUDA, with the reason printed) or auto (default)",
    )
    bb.set_defaults(func=cmd_batch_bench)


def cmd_batch_bench(args) -> int:
    from rich.table import Table

    from engine.engine import kernels_notice
    from engine.kernels import EXACT
    from harness.batch_bench import BatchBenchConfig, run_batch_bench
    from harness.native import geomean

    cfg = BatchBenchConfig(
        args.prompt_tokens,
        args.decode_tokens,
        tuple(args.concurrency),
        args.samples,
        args.warmup,
        args.seed,
        kernels=args.kernels,
    )
    tiers = {}

    def on_kernels(ks, name):
        tiers[name] = ks.tier
        console.print(f"{name}: kernels {ks.tier}" + (f" ({kernels_notice(ks)})" if kernels_notice(ks) else ""))

    models = targets(args)
    records = []
    table = Table(title=f"scheduler overhead ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode per request)")
    for col in ("model", "kernels", "measure", "engine", "baseline", "ratio", "paired", "tokens"):
        table.add_column(col)
    for name, path in models:
        comps = run_batch_bench(
            path,
            cfg,
            log=lambda m, name=name: console.print(f"{name}: {m}"),
            on_kernels=lambda ks, name=name: on_kernels(ks, name),
        )
        for comp in comps:
            records.append({"model": name, "kernels": tiers[name], **comp.as_record()})
            for base in comp.baselines:
                paired = comp.paired(base)
                table.add_row(
                    name,
                    tiers[name],
                    comp.label,
                    f"{comp.ours.median:.1f} {comp.unit}",
                    f"{base.name} {base.median:.1f}",
                    f"{comp.ratio(base):.3f}",
                    f"{geomean(paired):.3f} \\[{min(paired):.2f}-{max(paired):.2f}]",
                    "-"
                    if comp.tokens_identical is None
                    else "identical"
                    if comp.tokens_identical
                    else "[red]DIFFER[/]"
                    if tiers[name] == EXACT
                    else "differ (fast tier)",
                )
    out.print(table)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0
