"""`harness`: the benchmark and parity harness.

    harness models list                      registry, geometry, size, cache state
    harness models synth NAME [--seed S]     write a synthetic mlx-lm artifact
    harness parity [--models ...]            live oracle gate against mlx-lm
    harness native --models NAME             in-process speed: engine vs mlx-lm
    harness server-overhead --models NAME    in-process vs through `engine serve`
    harness kernels [--shapes qwen27b]       fast-tier kernels vs MLX's ops; --gate-model: numerics gate
    harness run all [--models ...]           the benchmark: real servers, frozen workloads, JSON + SQLite
    harness trials --arms A,B --seeds 5      paired blocks for A-vs-B claims
    harness report A.json [B.json] --out compare.html   offline HTML comparison
    harness db list | export RUN_ID          the run database
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from engine.errors import USER_ERRORS
from harness import kernels_cli, report_cli, run_cli, spec_cli
from harness.cli_common import CliError, console, out
from harness.cli_common import csv as _csv
from harness.cli_common import csv_ints as _csv_ints
from harness.cli_common import at_least_two, positive as _positive

def _model_source(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--models", type=_csv, help="registry names, comma-separated")
    src.add_argument("--model-path", type=Path, help="an mlx-lm model directory instead of a registry name")


def _targets(args) -> list:
    """(label, model directory) for --models or --model-path."""
    from engine.model_source import resolve_model_dir

    if args.model_path:
        return [(str(args.model_path), resolve_model_dir(model_path=args.model_path))]
    return [(name, resolve_model_dir(model=name, seed=args.seed)) for name in args.models]


def build_parser() -> argparse.ArgumentParser:
    from engine.kernels import AUTO, TIERS

    parser = argparse.ArgumentParser(
        prog="harness",
        description="Benchmark and parity harness for the engine, with stock mlx-lm as the reference.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", help="list or synthesize registry models")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ls = msub.add_parser("list", help="registry names with geometry, parameters, bytes and cache state")
    ls.add_argument("--tier", choices=["tiny", "small", "gpu", "draft"], help="only this tier")
    ls.add_argument("--seed", type=int, default=0, help="seed whose cache state to show (default 0)")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_models_list)
    syn = msub.add_parser(
        "synth",
        help="write a synthetic model artifact (mlx-lm format)",
        description="Synthesize deterministic random weights and a full-vocabulary tokenizer in mlx-lm's "
        "on-disk format. Without --out the artifact goes to the model cache, where --model NAME finds it.",
    )
    syn.add_argument("names", nargs="+", metavar="NAME", help="registry names, e.g. tiny-qwen35 qwen27b")
    syn.add_argument("--seed", type=int, default=0, help="weight seed (default 0); same name + seed = same bytes")
    syn.add_argument("--out", type=Path, help="write here instead of the cache (one NAME only)")
    syn.add_argument("--force", action="store_true", help="rewrite even if the artifact exists")
    syn.set_defaults(func=cmd_models_synth)

    par = sub.add_parser(
        "parity",
        help="compare our logits with mlx-lm's, bit for bit",
        description="Run the live oracle gate: both engines generate greedily from the same prompt ids on the "
        "same artifact; every forward's float32 logits and the final caches must be identical. "
        "Exits 1 on any mismatch.",
    )
    psrc = par.add_mutually_exclusive_group()
    psrc.add_argument("--models", type=_csv, help="registry base names (default: every tiny family)")
    psrc.add_argument("--model-path", type=Path, help="an mlx-lm model directory instead (--dtypes is ignored)")
    par.add_argument(
        "--batch", type=_csv_ints, default=[1],
        help="1 = B=1 against generate_step; B>1 = same-B scenarios against BatchGenerator (default 1)",
    )
    par.add_argument("--dtypes", type=_csv, default=["f32", "bf16", "4bit"], help="variants (default f32,bf16,4bit)")
    par.add_argument("--prompt-lengths", type=_csv_ints, default=[1, 7, 300, 2100], help="default 1,7,300,2100")
    par.add_argument("--steps", type=_positive, default=64, help="decode steps per case (default 64)")
    par.add_argument("--seed", type=int, default=0, help="artifact and prompt seed (default 0)")
    par.add_argument("--json", type=Path, help="also write the results here")
    par.set_defaults(func=cmd_parity)

    nat = sub.add_parser(
        "native",
        help="in-process speed: engine vs mlx-lm on the same prompt ids",
        description="Load our engine and mlx-lm side by side on one artifact, run warmups, then alternate "
        "measured requests (fresh caches, greedy, fixed length). Prints median prefill and decode rates, "
        "their ratios (engine / mlx-lm) and whether the generated ids are identical. --kernels picks the "
        "engine side's kernel tier; mlx-lm stays stock.",
    )
    _model_source(nat)
    nat.add_argument("--prompt-tokens", type=_positive, default=1024, help="prompt length (default 1024)")
    nat.add_argument("--decode-tokens", type=at_least_two, default=128, help="tokens generated, at least 2 (default 128)")
    nat.add_argument("--samples", type=_positive, default=5, help="measured requests per side (default 5)")
    nat.add_argument("--warmup", type=int, default=1, help="warmup requests per side (default 1)")
    nat.add_argument("--seed", type=int, default=0, help="artifact and prompt seed (default 0)")
    nat.add_argument("--kernels", choices=TIERS, default=AUTO,
                     help="the engine side's kernel tier: exact = MLX's operations, bit-exact with mlx-lm (tokens "
                     "must match); fast = custom CUDA kernels, equal to rounding (tokens may differ; CUDA only, "
                     "exact elsewhere with the reason printed); auto = fast on CUDA where its numerics gate "
                     "passed for the model's family (default auto)")  # fmt: skip
    nat.add_argument("--json", type=Path, help="also write the results here")
    nat.set_defaults(func=cmd_native)

    bb = sub.add_parser(
        "batch-bench",
        help="scheduler overhead: continuous vs serial lane, and C concurrent requests vs mlx-lm",
        description="In process, on one artifact: (1) one request through the continuous batcher vs the "
        "serial lane (decode tok/s); (2) C requests at once, aggregate output tok/s, ours vs mlx-lm's "
        "BatchGenerator at the same prefill batch size (8, as mlx_lm.server runs it), and the decode step at C "
        "rows (ms, while all C decode) against mlx-lm's and against the one-row step of (1). Sides alternate. "
        "--kernels picks the engine side's kernel tier; mlx-lm stays stock.",
    )
    _model_source(bb)
    bb.add_argument("--prompt-tokens", type=_positive, default=128, help="prompt length per request (default 128)")
    bb.add_argument("--decode-tokens", type=_positive, default=128, help="tokens per request (default 128)")
    bb.add_argument("--concurrency", type=_csv_ints, default=[4, 8], help="concurrent requests (default 4,8)")
    bb.add_argument("--samples", type=_positive, default=3, help="measured runs per side (default 3)")
    bb.add_argument("--warmup", type=int, default=1, help="warmup runs per side (default 1)")
    bb.add_argument("--seed", type=int, default=0)
    bb.add_argument("--kernels", choices=TIERS, default=AUTO,
                    help="the engine side's kernel tier: exact (ids must match mlx-lm's), fast (CUDA kernels, equal "
                    "to rounding; exact off CUDA, with the reason printed) or auto (default)")  # fmt: skip
    bb.add_argument("--json", type=Path, help="also write the results here")
    bb.set_defaults(func=cmd_batch_bench)

    so = sub.add_parser(
        "server-overhead",
        help="what HTTP costs: in-process generate vs `engine serve` (serial and continuous lanes)",
        description="On one artifact and the same prompt ids: greedy fixed-length requests in process, then "
        "streamed through `engine serve --batch 1` and `engine serve` (prompt cache off, one request at a "
        "time). Prints median TTFT and decode rate per arm and the ratio to in-process.",
    )
    _model_source(so)
    so.add_argument("--prompt-tokens", type=_positive, default=512, help="prompt length (default 512)")
    so.add_argument("--decode-tokens", type=_positive, default=128, help="tokens generated (default 128)")
    so.add_argument("--samples", type=_positive, default=6, help="measured rounds, one request per arm (default 6)")
    so.add_argument("--warmup", type=int, default=1, help="warmup rounds (default 1)")
    so.add_argument("--seed", type=int, default=0, help="artifact seed (default 0)")
    so.add_argument("--json", type=Path, help="also write the results here")
    so.set_defaults(func=cmd_server_overhead)

    wl = sub.add_parser(
        "workloads",
        help="write the standard frozen workloads to goldens/workloads/",
        description="Build each model's standard workload (seed 0 unless --workload-seed; every phase `harness run all` "
        "can ask for, long context 4096 included) from its artifact's tokenizer and write it under "
        "goldens/workloads/, where runs pick it up when their settings are covered.",
    )
    _model_source(wl)
    wl.add_argument("--workload-seed", type=int, default=0, help="workload seed (default 0)")
    wl.set_defaults(func=cmd_workloads, seed=0)

    report_cli.add_report(sub)
    report_cli.add_db(sub)
    spec_cli.add_spec(sub)
    kernels_cli.add_kernels(sub)

    run = sub.add_parser(
        "run",
        help="the benchmark: real servers (ours and stock mlx_lm.server), frozen workloads, SQLite + JSON",
        description="`harness run all`: for each model, start every arm as a real server process on the same "
        "artifact, replay the frozen token-ID workload through it (warmup, greedy parity probe, decode x5, cold "
        "and warm TTFT, aggregate throughput at each concurrency, long context), sample the server's RSS, and "
        "record everything to a JSON companion (after every cell) and an SQLite database. Refuses a loaded "
        "machine unless --diagnostic.",
    )
    run.add_argument("what", choices=["all"], help="`all`: every phase")
    run_cli.add_options(run)
    run.set_defaults(func=run_cli.cmd_run)

    tr = sub.add_parser(
        "trials",
        help="paired blocks for A-vs-B claims: one workload seed per block, arm order alternating",
        description="Run --seeds blocks; block i uses workload seed i and runs the arms in the given order "
        "(even blocks) or reversed (odd blocks), all into one JSON for `harness report`.",
    )
    run_cli.add_options(tr, arms_default="engine,mlx-lm")
    tr.add_argument("--seeds", type=_positive, default=5, help="blocks, one workload seed each (default 5)")
    tr.set_defaults(func=run_cli.cmd_trials)
    return parser


# ------------------------------------------------------------------ models


def cmd_models_list(args) -> int:
    from rich.table import Table

    from engine.registry import all_specs
    from engine.synth import artifact_dir, is_cached, parameter_count
    from engine.synth.weights import planned_weight_bytes

    tiers = (args.tier,) if args.tier else ("tiny", "small", "gpu", "draft")
    rows = []
    for spec in all_specs(tiers):
        g = spec.geometry
        cached = is_cached(spec.name, args.seed)
        rows.append(
            {
                "name": spec.name,
                "tier": spec.tier,
                "model_type": g.model_type,
                "layers": g.num_hidden_layers,
                "hidden": g.hidden_size,
                "vocab": g.vocab_size,
                "weights": f"{spec.quantization.bits}bit-g{spec.quantization.group_size}"
                if spec.quantization
                else {"float32": "f32", "bfloat16": "bf16"}[spec.dtype],
                "parameters": parameter_count(spec),
                "weight_bytes": planned_weight_bytes(spec),
                "cached": str(artifact_dir(spec.name, args.seed)) if cached else None,
            }
        )
    if args.json:
        out.print_json(json.dumps(rows))
        return 0
    table = Table(title="registry models (seed %d)" % args.seed)
    for col in ("name", "tier", "type", "layers", "hidden", "vocab", "weights", "params", "bytes", "cached"):
        table.add_column(col, justify="right" if col in ("layers", "hidden", "vocab", "params", "bytes") else "left")
    for r in rows:
        table.add_row(
            r["name"], r["tier"], r["model_type"], str(r["layers"]), str(r["hidden"]), str(r["vocab"]),
            r["weights"], _human(r["parameters"], ""), _human(r["weight_bytes"], "B"), "yes" if r["cached"] else "-",
        )
    out.print(table)
    return 0


def _human(n: float, unit: str) -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000
    return f"{n:.3g}P{unit}"


def cmd_models_synth(args) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from engine.registry import get_spec
    from engine.synth import artifact_dir, synthesize

    if args.out and len(args.names) > 1:
        raise CliError("--out takes one NAME; synthesize several into the cache instead")
    specs = [get_spec(n) for n in args.names]  # validate every name before writing anything
    for spec in specs:
        target = args.out or artifact_dir(spec.name, args.seed)
        if (target / "manifest.json").exists() and not args.force:
            console.print(f"{spec.name}: already at {target} (use --force to rewrite)")
            continue
        if target.exists() and not (target / "manifest.json").exists() and any(target.iterdir()):
            raise CliError(f"{target} exists and is not a synthesized artifact; choose another --out")
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(spec.name, total=None)

            def report(done: int, total: int, _name: str) -> None:
                progress.update(task, completed=done, total=total)

            synthesize(spec, args.seed, target, progress=report)
        manifest = json.loads((target / "manifest.json").read_text())
        console.print(
            f"{spec.name}: {manifest['parameters'] / 1e6:.1f}M parameters, "
            f"{manifest['total_bytes'] / 1e6:.1f} MB in {manifest['synthesis_seconds']:.1f}s -> {target}"
        )
        out.print(str(target))
    return 0


# ------------------------------------------------------------------ parity


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
            for name, mpath in models for n in args.prompt_lengths
        ]
    batches = sorted(b for b in args.batch if b > 1)
    if batches:
        cases += [
            replace(c, seed=args.seed, model_path=mpath)
            for name, mpath in models for c in scenario_cases(name, batches)
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
                r.case.model, str(r.case.prompt_len), str(r.case.steps), str(r.compared_steps),
                f"{r.max_abs_diff:.3g}", "-" if r.first_diff_step is None else str(r.first_diff_step),
                "same" if r.tokens_equal else "DIFFER", f"{r.cache_max_abs_diff:.3g}", _verdict(r.passed),
            )
        out.print(table)
    if batched:
        table = Table(title="same-B parity vs mlx-lm BatchGenerator")
        for col in ("model", "case", "rows", "forwards", "max |diff|", "first diff", "tokens", "result"):
            table.add_column(col)
        for r in batched:
            table.add_row(
                r.case.model, r.case.name, str(r.case.batch), str(r.forwards), f"{r.max_abs_diff:.3g}",
                r.first_diff or "-", "same" if r.tokens_equal else "DIFFER", _verdict(r.passed),
            )
        out.print(table)
    failed = [r for r in results if not r.passed]
    if args.json:
        args.json.write_text(json.dumps([r.as_record() for r in results], indent=2))
    out.print(f"{len(results) - len(failed)}/{len(results)} cases bit-exact")
    return 1 if failed else 0


# ------------------------------------------------------------------ native


def cmd_native(args) -> int:
    from rich.table import Table

    from engine.engine import kernels_notice
    from harness.native import NativeConfig, run_native

    cfg = NativeConfig(args.prompt_tokens, args.decode_tokens, args.samples, args.warmup, args.seed, args.kernels)
    results = []
    for name, path in _targets(args):
        console.print(f"{name}: warming up and measuring ({cfg.samples} samples per side) ...")
        results.append(run_native(name, path, cfg))
        notice = kernels_notice(results[-1].kernels)
        if notice:
            console.print(notice)
    table = Table(title=f"engine vs mlx-lm, in process ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode)")
    for col in ("model", "device", "kernels", "prefill tok/s", "ratio", "paired", "TTFT ms", "decode tok/s", "ratio",
                "paired", "tokens"):
        table.add_column(col)
    for r in results:
        table.add_row(
            r.model, r.device, r.kernels.tier,
            f"{r.engine.prefill_tps:.1f} vs {r.mlx_lm.prefill_tps:.1f}", f"{r.prefill_ratio:.3f}",
            _paired(r.paired_prefill_ratios()),
            f"{r.engine.ttft_ms:.0f} vs {r.mlx_lm.ttft_ms:.0f}",
            f"{r.engine.decode_tps:.2f} vs {r.mlx_lm.decode_tps:.2f}", f"{r.decode_ratio:.3f}",
            _paired(r.paired_decode_ratios()),
            "identical" if r.tokens_identical else ("[red]DIFFER[/]" if r.is_exact else "differ (fast tier)"),
        )
    out.print(table)
    out.print("medians per side and their ratio (engine / mlx-lm); paired: geometric mean \\[min-max] of "
              "per-request ratios, each engine request against the mlx-lm request beside it in time")
    for r in results:
        for arm in (r.engine, r.mlx_lm):
            out.print(f"{r.model} {arm.arm} decode steps per sample: median "
                      f"{', '.join(f'{v:.1f}' for v in arm.samples_median_step_ms)} ms, slowest "
                      f"{', '.join(f'{v:.1f}' for v in arm.samples_slowest_step_ms)} ms")
        for when, snap in r.machine.items():
            for problem in snap["problems"]:
                console.print(f"[yellow]{r.model}: {when} the samples, {problem}: its rates may be the machine's[/]")
    if args.json:
        args.json.write_text(json.dumps([r.as_record() for r in results], indent=2))
    return 0 if all(r.tokens_identical or not r.is_exact for r in results) else 1


def cmd_batch_bench(args) -> int:
    from rich.table import Table

    from harness.batch_bench import BatchBenchConfig, run_batch_bench
    from harness.native import geomean

    from engine.engine import kernels_notice
    from engine.kernels import EXACT

    cfg = BatchBenchConfig(args.prompt_tokens, args.decode_tokens, tuple(args.concurrency), args.samples,
                           args.warmup, args.seed, kernels=args.kernels)
    tiers = {}

    def on_kernels(ks, name):
        tiers[name] = ks.tier
        console.print(f"{name}: kernels {ks.tier}" + (f" ({kernels_notice(ks)})" if kernels_notice(ks) else ""))
    targets = _targets(args)
    records = []
    table = Table(title=f"scheduler overhead ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode per request)")
    for col in ("model", "kernels", "measure", "engine", "baseline", "ratio", "paired", "tokens"):
        table.add_column(col)
    for name, path in targets:
        comps = run_batch_bench(path, cfg, log=lambda m, name=name: console.print(f"{name}: {m}"),
                                on_kernels=lambda ks, name=name: on_kernels(ks, name))  # fmt: skip
        for comp in comps:
            records.append({"model": name, "kernels": tiers[name], **comp.as_record()})
            for base in comp.baselines:
                paired = comp.paired(base)
                table.add_row(
                    name, tiers[name], comp.label, f"{comp.ours.median:.1f} {comp.unit}",
                    f"{base.name} {base.median:.1f}", f"{comp.ratio(base):.3f}",
                    f"{geomean(paired):.3f} \\[{min(paired):.2f}-{max(paired):.2f}]",
                    "-" if comp.tokens_identical is None else "identical" if comp.tokens_identical
                    else "[red]DIFFER[/]" if tiers[name] == EXACT else "differ (fast tier)",
                )
    out.print(table)
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0


def cmd_server_overhead(args) -> int:
    from dataclasses import asdict

    from rich.table import Table

    from harness.parity import vocab_size
    from harness.server_overhead import OverheadConfig, measure, paired_decode_ratio

    cfg = OverheadConfig(args.prompt_tokens, args.decode_tokens, args.samples, args.warmup)
    table = Table(title=f"server overhead ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode, greedy, cold)")
    for col in ("model", "arm", "TTFT ms", "ratio", "decode tok/s", "ratio", "paired", "range", "load s", "tokens"):
        table.add_column(col)
    records, identical = [], True
    for name, path in _targets(args):
        console.print(f"{name}: in process, then through two servers ({cfg.samples} samples each) ...")
        arms = measure(path, vocab_size(path), cfg, log=lambda m, name=name: console.print(f"{name}: {m}"))
        base = arms[0]
        for arm in arms:
            same = arm.tokens == base.tokens
            identical &= same
            table.add_row(
                name, arm.arm, f"{arm.median_ttft_ms:.1f}", f"{arm.median_ttft_ms / base.median_ttft_ms:.3f}",
                f"{arm.median_decode_tps:.1f}", f"{arm.median_decode_tps / base.median_decode_tps:.3f}",
                f"{paired_decode_ratio(arm, base):.3f}", f"{min(arm.decode_tps):.1f}-{max(arm.decode_tps):.1f}",
                f"{arm.load_to_ready_s:.1f}" if arm.load_to_ready_s else "-",
                "identical" if same else "[red]DIFFER[/]",
            )  # fmt: skip
            records.append({"model": name, **asdict(arm)})
    out.print(table)
    out.print("medians; ratio = arm / in-process; paired: geometric mean of per-round decode ratios (arms "
              "alternate within each round); TTFT through a server is measured by the client (request sent -> "
              "first token event)")
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0 if identical else 1


def cmd_workloads(args) -> int:
    from dataclasses import replace

    from harness.workloads import STANDARD, build, golden_path, save, tokenizer_for

    for name, path in _targets(args):
        settings = replace(STANDARD, seed=args.workload_seed)
        encode, sha = tokenizer_for(path)
        workload = build(name, encode, sha, settings)
        dest = golden_path(name, settings)
        save(workload, dest)
        out.print(f"{name}: {dest} sha256 {workload.sha256[:16]}")
    return 0


def _verdict(passed: bool) -> str:
    return "[green]pass[/]" if passed else "[red]FAIL[/]"


def _paired(ratios: list[float]) -> str:
    from harness.native import geomean

    return f"{geomean(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, *USER_ERRORS) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
