"""`harness models list | synth`: the registry, and synthesized artifacts."""

from __future__ import annotations

import json
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from engine.registry import TIERS, all_specs, get_spec
from engine.synth import artifact_dir, is_cached, parameter_count, synthesize
from engine.synth.weights import planned_weight_bytes
from harness.cli_common import CliError, console, out, seed_option


def add_models(sub) -> None:
    models = sub.add_parser("models", help="list or synthesize registry models")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ls = msub.add_parser("list", help="registry names with geometry, parameters, bytes and cache state")
    ls.add_argument("--tier", choices=["tiny", "small", "gpu", "draft", "trained"], help="only this tier")
    seed_option(ls)
    # (not json_option: here --json is a switch, the list printed as JSON)
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_models_list)
    syn = msub.add_parser(
        "synth",
        help="write a synthetic model artifact (mlx-lm format)",
        description="Synthesize deterministic random weights and a full-vocabulary tokenizer in mlx-lm's "
        "on-disk format. Without --out the artifact goes to the model cache, where --model NAME finds it.",
    )
    syn.add_argument("names", nargs="+", metavar="NAME", help="registry names, e.g. tiny-qwen35 qwen27b")
    seed_option(syn)
    syn.add_argument("--out", type=Path, help="write here instead of the cache (one NAME only)")
    syn.add_argument("--force", action="store_true", help="rewrite even if the artifact exists")
    syn.set_defaults(func=cmd_models_synth)


def cmd_models_list(args) -> int:
    tiers = (args.tier,) if args.tier else TIERS
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
    table = Table(title=f"registry models (seed {args.seed})")
    for col in ("name", "tier", "type", "layers", "hidden", "vocab", "weights", "params", "bytes", "cached"):
        table.add_column(col, justify="right" if col in ("layers", "hidden", "vocab", "params", "bytes") else "left")
    for r in rows:
        table.add_row(
            r["name"],
            r["tier"],
            r["model_type"],
            str(r["layers"]),
            str(r["hidden"]),
            str(r["vocab"]),
            r["weights"],
            _human(r["parameters"], ""),
            _human(r["weight_bytes"], "B"),
            "yes" if r["cached"] else "-",
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
    if args.out and len(args.names) > 1:
        raise CliError("--out takes one NAME; synthesize several into the cache instead")
    specs = [get_spec(n) for n in args.names]  # validate every name before writing anything
    trained = [s.name for s in specs if s.tier == "trained"]
    if trained:
        raise CliError(f"{', '.join(trained)}: trained models are made by `python -m oracles.train`, not synthesized")
    for spec in specs:
        target = args.out or artifact_dir(spec.name, args.seed)
        if (target / "manifest.json").exists() and not args.force:
            console.print(f"{spec.name}: already synthesized (--force rewrites it)")
            out.print(str(target))
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
            f"{manifest['total_bytes'] / 1e6:.1f} MB in {manifest['synthesis_seconds']:.1f}s"
        )
        out.print(str(target))  # the path once, on stdout, for $(harness models synth NAME)
    return 0
