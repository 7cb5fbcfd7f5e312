"""`harness kernels`: the fast tier's kernels against MLX's operations, and its numerics gate."""

from __future__ import annotations

import json
from dataclasses import replace

from rich.table import Table

from engine.device import device_label
from engine.errors import UnknownModelError
from engine.kernels import FAST, KernelConfig
from engine.kernels.config import DEFAULT_STATE_DTYPE, STATE_DTYPES
from engine.model_source import resolve_model_dir
from engine.registry import all_specs, get_spec
from engine.synth.artifact import artifact_dir, is_cached
from harness.cli_common import (
    CliError,
    csv,
    csv_ints,
    enable_kernel_cache,
    json_option,
    kernel_cache_option,
    non_negative,
    positive,
    status,
)
from harness.cli_common import out as stdout
from harness.kernels.bench_config import BenchConfig
from harness.run.summary import fmt


def add_kernels(sub) -> None:
    p = sub.add_parser(
        "kernels",
        help="microbenchmark the fast tier's kernels on a model's shapes; optionally its whole-model numerics gate",
        description="Time each fast-tier kernel against MLX's built-in operation on the exact shapes of a registry "
        "model: the quantized GEMV / small-M GEMM on every distinct linear-layer shape for each row count (at one row "
        "also serially: each call waiting for the one before, as in a decode step), the "
        "projections that share an input in one launch (M <= 8, as the fast tier runs them), prompt chunks "
        "(--tokens minus one rows) as dequantize + one GEMM against MLX's quantized matmul, and the chunked "
        "Gated DeltaNet prefill against the per-token recurrence. Prints median time, effective "
        "GB/s and the fraction of --peak-gbs, speedups, and max |difference| against the built-in result. "
        "Off CUDA only the built-in side runs. With --gate-model, runs the whole-model numerics gate instead: "
        "the exact and the fast tier each against a float32 reference forward of the same artifact, teacher-forced "
        "on the exact tier's greedy tokens over the parity prompts (mean KL and top-1 agreement per tier; the fast "
        "tier passes with mean KL at most 1.25x the exact tier's + 1e-6 and top-1 agreement at most 1 point "
        "below); exits 1 when it fails.",
    )
    p.add_argument("--shapes", default="qwen27b", help="registry model whose shapes to use (default qwen27b)")
    d = BenchConfig()
    p.add_argument(
        "--rows", type=csv_ints, default=list(d.rows), help=f"activation rows M (default {','.join(map(str, d.rows))})"
    )
    p.add_argument(
        "--tokens",
        type=csv_ints,
        default=list(d.tokens),
        help="prefill lengths for Gated DeltaNet, "
        "and for the prompt-chunk table where long enough for the fast tier's dense path "
        f"(default {','.join(map(str, d.tokens))})",
    )
    p.add_argument("--max-shapes", type=positive, default=None, help="only the N largest linear shapes")
    p.add_argument(
        "--repeats", type=positive, default=d.repeats, help=f"timed repetitions, median reported (default {d.repeats})"
    )
    p.add_argument(
        "--calls",
        type=positive,
        default=d.calls,
        help=f"GEMV calls per evaluation (default {d.calls}; a decode step "
        "evaluates ~800 operations at once): each evaluation also pays MLX's own cost of a few hundred us on "
        "CUDA, which at 50 calls adds 4-10 us to every call",
    )
    p.add_argument(
        "--peak-gbs",
        type=float,
        default=d.peak_gbs,
        help="the machine's memory bandwidth in GB/s for the "
        f"fraction-of-limit column (default {d.peak_gbs:g}, an H200)",
    )
    p.add_argument(
        "--cold-mb",
        type=non_negative,
        default=d.cold_bytes >> 20,
        help="MB of weight copies the GEMV calls "
        f"rotate over, so each reads from memory as in a decode step (default {d.cold_bytes >> 20}, 5x the "
        "H200's L2); 0 times one copy, cache-warm",
    )
    p.add_argument(
        "--gate-model",
        default=None,
        help="registry model for the whole-model numerics gate (exact "
        "and fast tier against the float32 reference) instead of the kernel table",
    )
    p.add_argument(
        "--gate-rows",
        type=csv_ints,
        default=[1],
        help="rows decoding together in the gate, one gate "
        "each, comma-separated (default 1; e.g. 1,8): each row is scored against its own reference",
    )
    p.add_argument("--gate-steps", type=positive, default=64, help="decode steps per gate prompt (default 64)")
    p.add_argument(
        "--gate-greedy",
        type=_models_or_none,
        default=None,
        metavar="MODELS",
        help="with --gate-model: also the greedy agreement of the fast tier with the exact tier on these "
        "trained models at the gate's row counts (default: every trained model with committed weights; '' "
        "for none)",
    )
    p.add_argument(
        "--state-dtype",
        choices=STATE_DTYPES,
        default=DEFAULT_STATE_DTYPE,
        help="with --gate-model: the dtype the fast tier keeps DeltaNet states in (engine serve --state-dtype; "
        f"default {DEFAULT_STATE_DTYPE})",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="run the gate's fast tier off CUDA too (the chunked "
        "delta rule and compiled steps run; quantized layers fall back to MLX's op): for testing",
    )
    json_option(p)
    kernel_cache_option(p)
    p.set_defaults(func=cmd_kernels)


def _models_or_none(value: str) -> list[str]:
    """--gate-greedy's value: comma-separated names, or '' for none."""
    return csv(value) if value.strip() else []


def cmd_kernels(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser

    from harness.kernels.bench import BenchConfig, DeltaResult, GroupResult, PrefillResult, run_kernel_bench, verdicts

    enable_kernel_cache(args)
    if args.gate_model:
        return _gate(args)
    try:
        spec = get_spec(args.shapes)
    except UnknownModelError as e:
        raise CliError(str(e)) from None
    cfg = BenchConfig(
        rows=tuple(args.rows),
        tokens=tuple(args.tokens),
        repeats=args.repeats,
        calls=args.calls,
        peak_gbs=args.peak_gbs,
        max_shapes=args.max_shapes,
        cold_bytes=args.cold_mb << 20,
    )
    with status("timing") as progress:

        def timed(r):
            if isinstance(r, DeltaResult):
                label = f"T={r.tokens}"
            elif isinstance(r, GroupResult):
                label = f"{r.label} M={r.m}"
            else:
                label = f"{r.n}x{r.k} M={r.m}" + (" (prompt chunk)" if isinstance(r, PrefillResult) else "")
            progress.update(f"timed {label}")

        bench = run_kernel_bench(spec, cfg, on_result=timed)
    gemv, groups, prefill, delta = bench.gemv, bench.groups, bench.prefill, bench.delta
    weights = f"weights rotated over {cfg.cold_bytes >> 20} MB" if cfg.cold_bytes else "one copy of the weights"
    t = Table(title=f"quantized matmul on {spec.name} shapes ({device_label()}, {weights})")
    for col in (
        "N x K",
        "M",
        "layers",
        "mlx us",
        "mlx GB/s",
        "kernel us",
        "kernel GB/s",
        "of limit",
        "speedup",
        "serial us mlx / kernel",
        "serial GB/s",
        "max|diff|",
        "note",
    ):
        t.add_column(col)
    for r in gemv:
        gbs = r.gbs(r.kernel_us)
        serial = f"{fmt(r.serial_builtin_us)} / {fmt(r.serial_kernel_us)}" if r.serial_builtin_us else ""
        t.add_row(
            f"{r.n}x{r.k}",
            str(r.m),
            str(r.layers),
            fmt(r.builtin_us),
            fmt(r.gbs(r.builtin_us), ".0f"),
            fmt(r.kernel_us),
            fmt(gbs, ".0f"),
            fmt(gbs and gbs / cfg.peak_gbs, ".0%"),
            fmt(r.speedup, ".2f"),
            serial,
            fmt(r.gbs(r.serial_kernel_us), ".0f"),
            fmt(r.max_abs_diff, ".2e"),
            r.note,
        )
    stdout.print(t)
    stdout.print(
        "serial: each call adds to the previous call's output, so it waits for it (as in a decode step); "
        "the other columns time independent calls, which the device may overlap"
    )
    if groups:
        gt = Table(title="projections that share an input: MLX's op once per matrix vs the kernel once for all")
        for col in (
            "group",
            "N each",
            "K",
            "M",
            "modules",
            "mlx us",
            "kernel us",
            "kernel GB/s",
            "of limit",
            "speedup",
            "note",
        ):
            gt.add_column(col)
        for r in groups:
            gbs = r.gbs(r.kernel_us)
            gt.add_row(
                r.label,
                "+".join(map(str, r.rows)),
                str(r.k),
                str(r.m),
                str(r.layers),
                fmt(r.builtin_us),
                fmt(r.kernel_us),
                fmt(gbs, ".0f"),
                fmt(gbs and gbs / cfg.peak_gbs, ".0%"),
                fmt(r.speedup, ".2f"),
                r.note,
            )
        stdout.print(gt)
    if prefill:
        pt = Table(title="prompt chunks: MLX's quantized matmul vs dequantize + one GEMM")
        for col in (
            "N x K",
            "M",
            "layers",
            "mlx us",
            "mlx TFLOP/s",
            "dense us",
            "dense TFLOP/s",
            "speedup",
            "max|diff|",
            "note",
        ):
            pt.add_column(col)
        for r in prefill:
            pt.add_row(
                f"{r.n}x{r.k}",
                str(r.m),
                str(r.layers),
                fmt(r.builtin_us),
                fmt(r.tflops(r.builtin_us), ".0f"),
                fmt(r.kernel_us),
                fmt(r.tflops(r.kernel_us), ".0f"),
                fmt(r.speedup, ".2f"),
                fmt(r.max_abs_diff, ".2e"),
                r.note,
            )
        stdout.print(pt)
    if delta:
        d = Table(title="Gated DeltaNet prefill: per-token recurrence vs chunked")
        for col in ("tokens", "heads k/v", "recurrence ms", "chunked ms", "speedup", "max|diff| y", "max|diff| state"):
            d.add_column(col)
        for r in delta:
            d.add_row(
                str(r.tokens),
                f"{r.heads_k}/{r.heads_v}",
                fmt(r.builtin_ms, ".2f"),
                fmt(r.kernel_ms, ".2f"),
                fmt(r.speedup, ".1f"),
                fmt(r.max_abs_diff_y, ".2e"),
                fmt(r.max_abs_diff_state, ".2e"),
            )
        stdout.print(d)
    checks = verdicts(gemv, delta, cfg.peak_gbs)
    for v in checks:
        mark = {True: "met", False: "NOT met", None: "not measured"}[v.ok]
        stdout.print(
            f"{v.criterion}: {fmt(v.measured, '.2f')} (target {v.target:g}) {mark}" + (f" ({v.note})" if v.note else "")
        )
    record = {
        "shapes": spec.name,
        "verdicts": [vars(v) for v in checks],
        "device": device_label(),
        "peak_gbs": cfg.peak_gbs,
        "cold_bytes": cfg.cold_bytes,
        "gemv": [
            dict(
                vars(r),
                builtin_gbs=r.gbs(r.builtin_us),
                kernel_gbs=r.gbs(r.kernel_us),
                serial_kernel_gbs=r.gbs(r.serial_kernel_us),
            )
            for r in gemv
        ],
        "groups": [dict(vars(r), kernel_gbs=r.gbs(r.kernel_us), speedup=r.speedup) for r in groups],
        "prefill": [
            dict(vars(r), builtin_tflops=r.tflops(r.builtin_us), kernel_tflops=r.tflops(r.kernel_us), speedup=r.speedup)
            for r in prefill
        ],
        "delta": [dict(vars(r), speedup=r.speedup) for r in delta],
    }
    _save(args.json, record)
    return 0


def _save(path, record: dict) -> None:
    """Write `record` as JSON to `path` (None: nowhere)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))


def _gate(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from harness.kernels.gate import KL_RATIO, KL_SLACK, TOP1_MARGIN, run_gates

    try:
        path = resolve_model_dir(args.gate_model, None)
    except UnknownModelError as e:
        raise CliError(str(e)) from None
    fast = replace(KernelConfig.from_env(FAST), force=args.force, state_dtype=args.state_dtype)
    with status(f"gate on {args.gate_model}") as progress:
        results = run_gates(
            path,
            args.gate_rows,
            steps=args.gate_steps,
            fast=fast,
            on_progress=lambda m: progress.update(f"gate on {args.gate_model}: {m}"),
        )
    for gate in results:
        rows = gate.rows
        t = Table(
            title=f"numerics gate on {args.gate_model}, {rows} row{'s' * (rows > 1)} a batch, {args.gate_steps} "
            "steps: each tier against the float32 reference"
        )
        for col in (
            "prompt",
            "seed",
            "exact mean KL",
            "fast mean KL",
            "exact top-1",
            "fast top-1",
            "exact max KL",
            "fast max KL",
            "exact max |dlogit|",
            "fast max |dlogit|",
        ):
            t.add_column(col)
        for p in gate.prompts + (None,):
            e, f = (p.exact, p.fast) if p else (gate.exact, gate.fast)
            t.add_row(
                str(p.prompt_len) if p else "all",
                str(p.seed) if p else "",
                f"{e.mean_kl:.3e}",
                f"{f.mean_kl:.3e}",
                f"{e.top1_agreement:.1%}",
                f"{f.top1_agreement:.1%}",
                f"{e.max_kl:.2e}",
                f"{f.max_kl:.2e}",
                f"{e.max_abs_logit_diff:.3g}",
                f"{f.max_abs_logit_diff:.3g}",
            )
        stdout.print(t)
        e, f = gate.exact, gate.fast
        stdout.print(
            f"gate {'PASS' if gate.passed else 'FAIL'} at {rows} row{'s' * (rows > 1)}: mean KL fast "
            f"{f.mean_kl:.3e} vs bound {KL_RATIO:g} x exact {e.mean_kl:.3e} + {KL_SLACK:g} "
            f"({'ok' if gate.kl_passed else 'over'}); top-1 fast {f.top1_agreement:.2%} vs exact "
            f"{e.top1_agreement:.2%} - {TOP1_MARGIN:.0%} ({'ok' if gate.top1_passed else 'under'}); "
            f"fast tier ran {gate.fast_kernels['tier']}"
        )
    greedy = _greedy_gate(args, fast)
    record = {
        "gate": {
            "model": args.gate_model,
            "passed": all(g.passed for g in results + greedy),
            "results": [g.as_record() for g in results],
            "greedy": [g.as_record() for g in greedy],
        }
    }
    _save(args.json, record)
    return 0 if record["gate"]["passed"] else 1


def _greedy_gate(args, fast) -> list:
    """The greedy agreement part of the gate (`harness.kernels.greedy_gate`), printed as a table."""
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from harness.kernels.greedy_gate import run_greedy_gate

    if args.gate_greedy is None:
        names = [spec.name for spec in all_specs(("trained",)) if is_cached(spec.name)]
        if not names:  # said, so that a passing record without it is not read as a passed greedy part
            stdout.print("greedy agreement: not run (no trained model has weights here: `python -m oracles.train`)")
    else:
        names = args.gate_greedy
        for name in names:
            try:
                tier = get_spec(name).tier
            except UnknownModelError as e:
                raise CliError(str(e)) from None
            if tier != "trained":
                raise CliError(f"--gate-greedy takes trained models; {name} is in the {tier} tier")
            if not is_cached(name):
                raise CliError(
                    f"{name} has no weights in {artifact_dir(name).parent}: train them with `python -m oracles.train`"
                )
    results = []
    with status("greedy agreement") as progress:
        for name in names:
            results += run_greedy_gate(
                name,
                artifact_dir(name),
                args.gate_rows,
                steps=args.gate_steps,
                fast=fast,
                on_progress=lambda m: progress.update(f"greedy agreement: {m}"),
            )
    if results:
        t = Table(
            title=f"greedy agreement on trained models: of each prompt's {args.gate_steps} greedy steps on the "
            "exact tier, those the fast tier (fed the same path) chose too"
        )
        for col in ("model", "rows", "paths", "mean", "min", "bound", "fast tier ran", "verdict"):
            t.add_column(col)
        for g in results:
            t.add_row(
                g.model,
                str(g.rows),
                str(len(g.agreed)),
                f"{g.mean:.1f}",
                str(min(g.agreed)),
                f"{g.bound:g}",
                g.fast_tier,
                "PASS" if g.passed else "FAIL",
            )
        stdout.print(t)
    return results
