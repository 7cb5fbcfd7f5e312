"""The gates' subcommands, each parser beside its run: `harness parity` (the live oracle gate, our logits
against mlx-lm's bit for bit, B=1 and same-B) and `harness quality` (held-out perplexity and KL against the
reference for weight quantizations, quantized KV and kernel tiers)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rich.progress import Progress
from rich.table import Table

from engine.model_source import resolve_model_dir
from engine.registry import base_names, get_spec
from harness.cli_common import (
    CliError,
    console,
    csv,
    csv_ints,
    json_option,
    model_source,
    out,
    positive,
    seed_option,
    status,
    targets,
    verdict,
)
from harness.gates.quality import QualitySettings, markdown, measure


def add_parity(sub) -> None:
    par = sub.add_parser(
        "parity",
        help="compare our logits with mlx-lm's, bit for bit",
        description="Run the live oracle gate: both engines generate greedily from the same prompt ids on the "
        "same artifact; every forward's float32 logits and the final caches must be identical. "
        "Exits 1 on any mismatch.",
    )
    psrc = par.add_mutually_exclusive_group()
    psrc.add_argument("--models", type=csv, help="registry base names (default: every tiny family)")
    psrc.add_argument("--model-path", type=Path, help="an mlx-lm model directory instead (--dtypes is ignored)")
    par.add_argument(
        "--batch",
        type=csv_ints,
        default=[1],
        help="1 = B=1 against generate_step; B>1 = same-B scenarios against BatchGenerator (default 1)",
    )
    par.add_argument("--dtypes", type=csv, default=["f32", "bf16", "4bit"], help="variants (default f32,bf16,4bit)")
    par.add_argument("--prompt-lengths", type=csv_ints, default=[1, 7, 300, 2100], help="default 1,7,300,2100")
    par.add_argument("--steps", type=positive, default=64, help="decode steps per case (default 64)")
    seed_option(par, prompts=True)
    json_option(par)
    par.set_defaults(func=cmd_parity)


def cmd_parity(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from harness.gates import parity
    from harness.gates.batch_parity import BatchCase, run_batch_case, scenario_cases

    if any(b < 1 for b in args.batch):
        raise CliError("--batch takes positive integers, e.g. --batch 1 or --batch 2,3,4,8")
    if args.model_path:
        path = resolve_model_dir(model_path=args.model_path)
        models = [(path.name, str(path))]
    else:
        bases = args.models or base_names("tiny")
        for b in bases:
            for d in args.dtypes:
                get_spec(f"{b}-{d}")  # unknown names fail before any work
        models = [(parity.model_name(b, d), None) for b in bases for d in args.dtypes]
    cases = []
    if 1 in args.batch:
        cases += [
            parity.ParityCase(name, n, args.steps, args.seed, model_path=mpath)
            for name, mpath in models
            for n in args.prompt_lengths
        ]
    batches = sorted(b for b in args.batch if b > 1)
    if batches:
        cases += [
            replace(c, seed=args.seed, model_path=mpath)
            for name, mpath in models
            for c in scenario_cases(name, batches)
        ]
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("parity", total=len(cases))
        for case in cases:
            progress.update(task, description=case.label)
            run = run_batch_case if isinstance(case, BatchCase) else parity.run_case
            results.append(run(case))
            progress.advance(task)
    single = [r for r in results if isinstance(r.case, parity.ParityCase)]
    batched = [r for r in results if isinstance(r.case, BatchCase)]
    if single:
        table = Table(title="parity vs mlx-lm generate_step (B=1)")
        for col in ("model", "prompt", "steps", "forwards", "max |diff|", "first diff", "tokens", "cache", "result"):
            table.add_column(col)
        for r in single:
            table.add_row(
                r.case.model,
                str(r.case.prompt_len),
                str(r.case.steps),
                str(r.compared_steps),
                f"{r.max_abs_diff:.3g}",
                "-" if r.first_diff_step is None else str(r.first_diff_step),
                "same" if r.tokens_equal else "DIFFER",
                f"{r.cache_max_abs_diff:.3g}",
                verdict(r.passed),
            )
        out.print(table)
    if batched:
        table = Table(title="same-B parity vs mlx-lm BatchGenerator")
        for col in ("model", "case", "rows", "forwards", "max |diff|", "first diff", "tokens", "result"):
            table.add_column(col)
        for r in batched:
            table.add_row(
                r.case.model,
                r.case.name,
                str(r.case.batch),
                str(r.forwards),
                f"{r.max_abs_diff:.3g}",
                r.first_diff or "-",
                "same" if r.tokens_equal else "DIFFER",
                verdict(r.passed),
            )
        out.print(table)
    failed = [r for r in results if not r.passed]
    if args.json:
        args.json.write_text(json.dumps([r.as_record() for r in results], indent=2))
    out.print(f"{len(results) - len(failed)}/{len(results)} cases bit-exact")
    return 1 if failed else 0


def add_quality(sub) -> None:
    p = sub.add_parser(
        "quality",
        help="held-out perplexity and KL vs the reference for weight bits, KV bits and kernel tiers",
        description="Score each model on held-out text (oracles.train_data's held-out files, in the model's own "
        "tokenizer): perplexity, and the mean KL divergence and top-1 agreement of every position's next-token "
        "distribution against the reference (the artifact on the exact tier). Variants: the reference with a "
        "quantized KV cache (--kv-bits), an unquantized artifact quantized in memory (--weight-bits, affine, group "
        "64), and the fast tier where the device runs it. Windows start from an empty cache and go through the "
        "model in chunks, as prompts are prefilled.",
    )
    model_source(p)
    seed_option(p)
    p.add_argument("--tokens", type=positive, default=4096, help="held-out tokens scored (default 4096)")
    p.add_argument(
        "--window", type=positive, default=512, help="tokens a window, each from an empty cache (default 512)"
    )
    p.add_argument("--chunk", type=positive, default=128, help="tokens a forward within a window (default 128)")
    p.add_argument(
        "--weight-bits",
        type=_bits,
        default=[8, 4],
        help="in-memory weight quantizations of an unquantized artifact (default 8,4; '' for none)",
    )
    p.add_argument("--kv-bits", type=_bits, default=[8, 4], help="quantized KV caches (default 8,4; '' for none)")
    p.add_argument(
        "--kv-group-size",
        type=positive,
        default=64,
        help="quantized KV's group size (default 64; it must divide the head size)",
    )
    p.add_argument("--no-fast", action="store_true", help="skip the fast tier even where the device runs it")
    json_option(p)
    p.add_argument("--md", type=Path, help="also write a Markdown table here")
    p.set_defaults(func=cmd_quality)


def _bits(value: str) -> list[int]:
    """Comma-separated bit widths; '' for none."""
    return csv_ints(value) if value.strip() else []


def cmd_quality(args) -> int:
    if set(args.kv_bits) - {4, 8}:
        raise CliError(f"--kv-bits takes 4 and 8 (quantized KV caches), got {','.join(map(str, args.kv_bits))}")
    if set(args.weight_bits) - {2, 3, 4, 5, 6, 8}:
        raise CliError(f"--weight-bits takes 2, 3, 4, 5, 6 and 8, got {','.join(map(str, args.weight_bits))}")
    settings = QualitySettings(
        tokens=args.tokens, window=args.window, chunk=args.chunk, kv_group_size=args.kv_group_size
    )
    results = []
    for label, path in targets(args):
        with status(f"{label}: loading") as progress:

            def say(line: str, label: str = label) -> None:
                progress.update(f"{label}: {line}")

            try:
                results.append(measure(label, path, settings, args.weight_bits, args.kv_bits, not args.no_fast, say))
            except ValueError as e:  # a setting the model cannot take (KV group size, too little held-out text)
                raise CliError(f"{label}: {e}") from None
    table = markdown(results)
    if args.json:
        args.json.write_text(json.dumps([r.as_json() for r in results], indent=2) + "\n")
    if args.md:
        args.md.write_text(table)
    out.print(table, markup=False, highlight=False)
    return 0
