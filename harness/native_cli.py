"""`harness native`: in-process speed, engine against mlx-lm on the same prompt ids."""

from __future__ import annotations

import json

from harness.cli_common import (
    at_least_two,
    console,
    kernels_option,
    measured_options,
    model_source,
    out,
    paired,
    targets,
)


def add_native(sub) -> None:
    nat = sub.add_parser(
        "native",
        help="in-process speed: engine vs mlx-lm on the same prompt ids",
        description="Load our engine and mlx-lm side by side on one artifact, run warmups, then alternate "
        "measured requests (fresh caches, greedy, fixed length). Prints median prefill and decode rates, "
        "their ratios (engine / mlx-lm) and whether the generated ids are identical. --kernels picks the "
        "engine side's kernel tier; mlx-lm stays stock.",
    )
    model_source(nat)
    measured_options(
        nat, prompt_tokens=1024, decode_tokens=128, samples=5, unit="requests per side", decode_type=at_least_two
    )
    kernels_option(
        nat,
        "the engine side's kernel tier: exact = MLX's operations, bit-exact with mlx-lm (tokens "
        "must match); fast = custom CUDA kernels, equal to rounding (tokens may differ; CUDA only, "
        "exact elsewhere with the reason printed); auto = fast on CUDA where its numerics gate "
        "passed for the model's family (default auto)",
    )
    nat.set_defaults(func=cmd_native)


def cmd_native(args) -> int:
    from rich.table import Table

    from engine.engine import kernels_notice
    from harness.native import NativeConfig, run_native

    cfg = NativeConfig(args.prompt_tokens, args.decode_tokens, args.samples, args.warmup, args.seed, args.kernels)
    results = []
    for name, path in targets(args):
        console.print(f"{name}: warming up and measuring ({cfg.samples} samples per side) ...")
        results.append(run_native(name, path, cfg))
        notice = kernels_notice(results[-1].kernels)
        if notice:
            console.print(notice)
    table = Table(title=f"engine vs mlx-lm, in process ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode)")
    for col in (
        "model",
        "device",
        "kernels",
        "prefill tok/s",
        "ratio",
        "paired",
        "TTFT ms",
        "decode tok/s",
        "ratio",
        "paired",
        "tokens",
    ):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.model,
            r.device,
            r.kernels.tier,
            f"{r.engine.prefill_tps:.1f} vs {r.mlx_lm.prefill_tps:.1f}",
            f"{r.prefill_ratio:.3f}",
            paired(r.paired_prefill_ratios()),
            f"{r.engine.ttft_ms:.0f} vs {r.mlx_lm.ttft_ms:.0f}",
            f"{r.engine.decode_tps:.2f} vs {r.mlx_lm.decode_tps:.2f}",
            f"{r.decode_ratio:.3f}",
            paired(r.paired_decode_ratios()),
            "identical" if r.tokens_identical else ("[red]DIFFER[/]" if r.is_exact else "differ (fast tier)"),
        )
    out.print(table)
    out.print(
        "medians per side and their ratio (engine / mlx-lm); paired: geometric mean \\[min-max] of "
        "per-request ratios, each engine request against the mlx-lm request beside it in time"
    )
    for r in results:
        for arm in (r.engine, r.mlx_lm):
            out.print(
                f"{r.model} {arm.arm} decode steps per sample: median "
                f"{', '.join(f'{v:.1f}' for v in arm.samples_median_step_ms)} ms, slowest "
                f"{', '.join(f'{v:.1f}' for v in arm.samples_slowest_step_ms)} ms"
            )
        for when, snap in r.machine.items():
            for problem in snap["problems"]:
                console.print(f"[yellow]{r.model}: {when} the samples, {problem}: its rates may be the machine's[/]")
    if args.json:
        args.json.write_text(json.dumps([r.as_record() for r in results], indent=2))
    return 0 if all(r.tokens_identical or not r.is_exact for r in results) else 1
