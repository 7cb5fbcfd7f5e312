"""`harness parity`: the live oracle gate, our logits against mlx-lm's bit for bit (B=1 and same-B)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harness.cli_common import CliError, console, csv, csv_ints, out, positive, verdict


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
    par.add_argument("--seed", type=int, default=0, help="artifact and prompt seed (default 0)")
    par.add_argument("--json", type=Path, help="also write the results here")
    par.set_defaults(func=cmd_parity)


def cmd_parity(args) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from engine.model_source import resolve_model_dir
    from engine.registry import base_names, get_spec
    from harness import parity
    from harness.batch_parity import BatchCase, run_batch_case, scenario_cases

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
