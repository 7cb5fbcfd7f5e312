"""The in-process benchmarks' subcommands, each parser beside its run: `harness native` (engine against mlx-lm
on the same prompt ids), `harness batch-bench` (the continuous lane against the serial lane and mlx-lm's
BatchGenerator), `harness server-overhead` (in-process generate against `engine serve`), `harness startup` (load
to ready, bursts after ready, lone against serial, restart) and `harness spec` (speculative against plain
decoding)."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from engine.errors import UnknownModelError
from engine.kernels import EXACT
from engine.kernels.kept import Kept
from engine.registry import get_spec
from harness.cli_common import (
    CliError,
    at_least_two,
    console,
    csv_ints,
    enable_kernel_cache,
    json_option,
    kernel_cache_option,
    kernels_option,
    measured_options,
    model_source,
    non_negative,
    out,
    positive,
    positive_seconds,
    seed_option,
    status,
    targets,
    verdict,
)
from harness.run.stats import geomean


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
    kernel_cache_option(nat)
    nat.set_defaults(func=cmd_native)


def cmd_native(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from engine.engine import kernels_notice
    from harness.bench.native import NativeConfig, run_native

    enable_kernel_cache(args)
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
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from engine.engine import kernels_notice
    from harness.bench.batch import BatchBenchConfig, run_batch_bench

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


def add_server_overhead(sub) -> None:
    so = sub.add_parser(
        "server-overhead",
        help="what HTTP costs: in-process generate vs `engine serve` (serial and continuous lanes)",
        description="On one artifact and the same prompt ids: greedy fixed-length requests in process, then "
        "streamed through `engine serve --batch 1` and `engine serve` (prompt cache off, one request at a "
        "time). Prints median TTFT and decode rate per arm and the ratio to in-process.",
    )
    model_source(so)
    measured_options(so, prompt_tokens=512, decode_tokens=128, samples=6, unit="rounds, one request per arm")
    so.set_defaults(func=cmd_server_overhead)


def cmd_server_overhead(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from harness.bench.server_overhead import OverheadConfig, measure, paired_decode_ratio
    from harness.gates.parity import vocab_size

    cfg = OverheadConfig(args.prompt_tokens, args.decode_tokens, args.samples, args.warmup)
    table = Table(title=f"server overhead ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode, greedy, cold)")
    for col in ("model", "arm", "TTFT ms", "ratio", "decode tok/s", "ratio", "paired", "range", "load s", "tokens"):
        table.add_column(col)
    records, identical = [], True
    for name, path in targets(args):
        console.print(f"{name}: in process, then through two servers ({cfg.samples} samples each) ...")
        arms = measure(path, vocab_size(path), cfg, log=lambda m, name=name: console.print(f"{name}: {m}"))
        base = arms[0]
        for arm in arms:
            same = arm.tokens == base.tokens
            identical &= same
            table.add_row(
                name,
                arm.arm,
                f"{arm.median_ttft_ms:.1f}",
                f"{arm.median_ttft_ms / base.median_ttft_ms:.3f}",
                f"{arm.median_decode_tps:.1f}",
                f"{arm.median_decode_tps / base.median_decode_tps:.3f}",
                f"{paired_decode_ratio(arm, base):.3f}",
                f"{min(arm.decode_tps):.1f}-{max(arm.decode_tps):.1f}",
                f"{arm.load_to_ready_s:.1f}" if arm.load_to_ready_s else "-",
                "identical" if same else "[red]DIFFER[/]",
            )
            records.append({"model": name, **asdict(arm)})
    out.print(table)
    out.print(
        "medians; ratio = arm / in-process; paired: geometric mean of per-round decode ratios (arms "
        "alternate within each round); TTFT through a server is measured by the client (request sent -> "
        "first token event)"
    )
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0 if identical else 1


LONE_RATIO = 0.97  # the lone request's decode rate on the default server, at least this times the serial lane's


def add_startup(sub) -> None:
    p = sub.add_parser(
        "startup",
        help="what clients wait for around a server start: load to ready, bursts after ready, lone vs serial",
        description="Starts `engine serve` on a kernel cache directory and times load to ready (the warm-up's "
        "stages as the server reports them), sends one request and then each burst of concurrent requests "
        "(TTFT quantiles, the p99 against --ttft-slo-ms, and the forward shapes and kernel builds the server first ran "
        "during each: compilations while requests waited), alternates lone requests between it and a "
        "`--batch 1` server (the serial lane), and restarts it on the same kernel cache directory.",
    )
    model_source(p)
    seed_option(p, prompts=True)
    p.add_argument("--prompt-tokens", type=positive, default=128, help="prompt length of every request (default 128)")
    p.add_argument(
        "--tokens", type=positive, default=64, help="output tokens of the first request and the bursts (default 64)"
    )
    p.add_argument(
        "--bursts", type=csv_ints, default=[32], help="concurrent requests of each burst, in order (default 32)"
    )
    p.add_argument("--lone-tokens", type=positive, default=128, help="output tokens of a lone request (default 128)")
    p.add_argument(
        "--rounds",
        type=non_negative,
        default=3,
        help="lone rounds against a `--batch 1` server (started first), after one warm-up round; 0: none "
        "(default 3). Where the default server then cannot start beside it (device memory), the serial server is "
        "stopped and the run goes on without lone rounds",
    )
    p.add_argument(
        "--serial-kernel-cache",
        choices=("own", "shared"),
        default="own",
        help="the `--batch 1` server's kernel cache: own (default), a fresh directory, so that the "
        "default server's start is not helped by what it compiled; shared, the default server's, so "
        "that on a filled directory it compiles nothing (when the lone rounds are what is measured; it starts "
        "first, so on an empty directory the default server's start is no longer a fresh one)",
    )
    p.add_argument("--no-restart", dest="restart", action="store_false", help="skip the restart")
    p.add_argument(
        "--kernel-cache-dir", type=Path, help="the servers' --kernel-cache-dir (default: a fresh temporary directory)"
    )
    p.add_argument(
        "--server-args", default="", help="more `engine serve` options for every server (one string, shell-quoted)"
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=positive_seconds,
        default=2000.0,
        help="the most p99 TTFT a burst after ready may have (default 2000)",
    )
    p.add_argument(
        "--ready-timeout",
        type=positive_seconds,
        default=1800.0,
        help="seconds a server may take to be ready, and a request to finish (default 1800)",
    )
    p.add_argument("--log-dir", type=Path, help="keep each server's stdout and stderr under DIR/<start>/")
    json_option(p)
    p.set_defaults(func=cmd_startup)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def start_row(s) -> tuple[str, ...]:
    """A start's row of `harness startup`'s table: its label, load to ready, the warm-up's seconds and stages (and
    the dense copies `ENGINE_KEEP_DENSE=auto` kept after it), the kernel cache's counts."""
    stages = [
        f"{st['name']} {st['seconds']:.1f} s ({st['kernel_builds']} kernel builds)" for st in s.warmup.get("stages", [])
    ]
    kept = s.warmup.get("kept_dense")
    if kept:
        stages.append(f"then {Kept(**kept).copies()}")
    kc = s.warmup.get("kernel_cache") or {}
    cached = " / ".join(str(kc.get(k, "-")) for k in ("compiled", "found", "failed")) if kc else "-"
    return s.label, f"{s.load_to_ready_s:.1f}", str(s.warmup.get("seconds", "-")), "; ".join(stages) or "-", cached


def cmd_startup(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from harness.bench.startup import StartupConfig, measure
    from harness.gates.parity import vocab_size

    if any(n < 1 for n in args.bursts):
        raise CliError(f"--bursts are request counts >= 1, got {args.bursts}")
    try:
        server_args = tuple(shlex.split(args.server_args))
    except ValueError as e:
        raise CliError(f"--server-args: {e}") from None
    cfg = StartupConfig(
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.tokens,
        bursts=tuple(args.bursts),
        lone_tokens=args.lone_tokens,
        rounds=args.rounds,
        restart=args.restart,
        server_args=server_args,
        kernel_cache_dir=args.kernel_cache_dir,
        serial_kernel_cache=args.serial_kernel_cache,
        ttft_slo_ms=args.ttft_slo_ms,
        ready_timeout_s=args.ready_timeout,
        seed=args.seed,
        log_dir=args.log_dir,
    )
    results, ok = [], True
    for name, path in targets(args):
        r = measure(name, path, vocab_size(path), cfg, log=lambda m, name=name: console.print(f"{name}: {m}"))
        results.append(r)
        starts = Table(title=f"{name}: server starts (kernel cache {r.kernel_cache_dir})")
        for col in ("start", "load to ready s", "warm-up s", "warm-up stages", "kernels compiled / found / failed"):
            starts.add_column(col)
        for s in r.starts:
            starts.add_row(*start_row(s))
        out.print(starts)
        reqs = Table(title=f"{name}: requests after ready ({cfg.prompt_tokens}-token prompts)")
        for col in (
            "requests",
            "n",
            "TTFT p50 ms",
            "p99",
            "max",
            "decode tok/s",
            "failed",
            "new shapes",
            "kernel builds",
            "modules compiled",
            f"p99 <= {cfg.ttft_slo_ms:.0f} ms",
        ):
            reqs.add_column(col)
        for q in (q for q in r.requests if q.label != "lone"):
            met = q.meets(cfg.ttft_slo_ms)
            ok &= met
            reqs.add_row(
                q.label,
                str(q.size),
                _ms(q.quantile(0.5)),
                _ms(q.quantile(0.99)),
                _ms(q.quantile(1.0)),
                "-" if q.decode_tps is None else f"{q.decode_tps:.1f}",
                str(len(q.errors)),
                str(q.new_shapes),
                str(q.kernel_builds),
                str(q.compiled_modules),
                verdict(met),
            )
        out.print(reqs)
        for e in r.errors:
            ok = False
            out.print(f"{name}: [red]{e[:500]}[/]")
        if r.lone is not None and r.lone.ratio is not None:
            lone_ok = r.lone.ratio >= LONE_RATIO
            ok &= lone_ok
            out.print(
                f"{name}: lone request decode {statistics_line(r.lone.default_tps)} tok/s on the default server, "
                f"{statistics_line(r.lone.serial_tps)} on the serial lane; paired ratio {r.lone.ratio:.3f} "
                f"(>= {LONE_RATIO}: {verdict(lone_ok)})"
            )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2, default=str))
    return 0 if ok else 1


def statistics_line(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def add_spec(sub) -> None:
    p = sub.add_parser(
        "spec",
        help="speculative decoding vs plain decoding on one target (decode rate, acceptance, token identity)",
        description="Load the target once and run, per block, one frozen natural-text prompt on every arm in a "
        "rotating order: plain (the baseline), self (the target as its own draft: the acceptance upper bound), "
        "draft:NAME (a draft model with the target's tokenizer), ngram (prompt lookup), ngram-miss (prompt lookup "
        "with every draft moved off by one: what speculation costs when no draft is accepted), mtp (the target's "
        "Qwen3.5 MTP head). Prints median decode rate and TTFT, acceptance, tokens per target forward, "
        "replays per round, the time of one target forward (a verify window's cost beside a plain step's), the "
        "paired ratio against plain, and whether each arm's tokens equal plain's. --kernels picks the target's "
        "kernel tier; the output names the tier that runs.",
    )
    p.add_argument("--model", default="small-qwen35", help="registry name of the target (default small-qwen35)")
    p.add_argument(
        "--arms",
        default="plain,self,draft:small-qwen35-draft,ngram,mtp",
        help="comma-separated arms (default plain,self,draft:small-qwen35-draft,ngram,mtp; also ngram-miss: "
        "n-gram drafts moved off by one, what speculation costs when no draft is accepted)",
    )
    p.add_argument("--prompt-tokens", type=positive, default=256, help="prompt length (default 256)")
    p.add_argument("--decode-tokens", type=positive, default=128, help="tokens generated (default 128)")
    p.add_argument("--blocks", type=positive, default=5, help="prompts, each run on every arm (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warmup requests per arm (default 1)")
    p.add_argument("--num-draft", type=positive, default=3, help="drafts per round (default 3)")
    p.add_argument(
        "--policy",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="drafts per round: fixed = always --num-draft (default: what drafting costs and gives); "
        "adaptive = as `engine serve` does by default",
    )
    p.add_argument(
        "--rollback",
        choices=("trace", "replay"),
        default="trace",
        help="how recurrent layers undo rejected drafts (default trace; replay feeds kept tokens again)",
    )
    # (not seed_option: here --seed seeds the prompts alone, from the first block's on, not the target's artifact)
    p.add_argument("--seed", type=int, default=0, help="first block's prompt seed (default 0)")
    p.add_argument(
        "--text",
        choices=("corpus", "held-out"),
        default=None,
        help="prompts from the project's corpus "
        "or from the trained models' held-out Python source (default: held-out for a trained target, "
        "corpus otherwise)",
    )
    p.add_argument(
        "--concurrency",
        type=row_counts,
        default=(),
        help="comma-separated row counts, e.g. 1,4,8: run each arm with that many requests at once through the "
        "continuous batcher (plain rows against spec rows) instead of one request at a time",
    )
    kernels_option(
        p,
        "the target's kernel tier, in every arm (a draft model runs exact): exact = MLX's operations; fast = "
        "custom CUDA kernels, equal to rounding (CUDA only, exact elsewhere); auto = fast on CUDA where its "
        "numerics gate passed for the model's family (default auto)",
    )
    json_option(p)
    p.add_argument(
        "--md",
        type=Path,
        help="write a Markdown table here (with --concurrency, rewritten after each block, as is --json)",
    )
    kernel_cache_option(p)
    p.set_defaults(func=cmd_spec)


def row_counts(text: str) -> tuple[int, ...]:
    """'1,4,8' -> (1, 4, 8): positive, each once."""
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"row counts must be integers, got {text!r}") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"row counts must be positive and each given once, got {text!r}")
    return counts


def cmd_spec(args) -> int:
    # on use: MLX and the model code load here, not when `harness --help` builds every parser
    from harness.bench.spec import (
        SpecBenchConfig,
        markdown,
        parse_arms,
        run_concurrent_bench,
        run_spec_bench,
        write,
    )

    try:
        arms = parse_arms(args.arms, args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        trained = get_spec(args.model).tier == "trained"
    except UnknownModelError as e:
        raise CliError(str(e)) from None
    text = args.text or ("held-out" if trained else "corpus")
    cfg = SpecBenchConfig(
        args.prompt_tokens,
        args.decode_tokens,
        args.blocks,
        args.warmup,
        args.num_draft,
        rollback=args.rollback,
        policy=args.policy,
        seed=args.seed,
        text=text,
        concurrency=args.concurrency,
        kernels=args.kernels,
    )
    enable_kernel_cache(args)
    with status("loading") as progress:
        if cfg.concurrency:  # written after each block, so a cut-off run keeps what it finished
            result = run_concurrent_bench(
                args.model, arms, cfg, progress.update, lambda so_far: write(so_far, args.json, args.md)
            )
        else:
            result = run_spec_bench(args.model, arms, cfg, on_progress=progress.update)
    write(result, args.json, args.md)
    out.print(markdown(result), markup=False, highlight=False)
    results = result if cfg.concurrency else [result]
    return 0 if all(all(a.same_tokens) for r in results for a in r.arms) else 1


def paired(ratios: list[float]) -> str:
    """Geometric mean [min-max] of paired ratios."""
    return f"{geomean(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
