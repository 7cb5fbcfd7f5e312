"""`harness startup`: load to ready, the first requests and bursts after ready, the lone request against the
serial lane, and a restart on the same kernel cache (harness/startup.py)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

from harness.cli_common import (
    CliError,
    console,
    csv_ints,
    model_source,
    non_negative,
    out,
    positive,
    positive_seconds,
    targets,
    verdict,
)

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
    p.add_argument("--seed", type=int, default=0, help="artifact and prompt seed (default 0)")
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
        help="lone rounds against a `--batch 1` server, after one warm-up round; 0: none (default 3)",
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
    p.add_argument("--json", type=Path, help="also write the results here")
    p.set_defaults(func=cmd_startup)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def cmd_startup(args) -> int:
    from rich.table import Table

    from harness.parity import vocab_size
    from harness.startup import StartupConfig, measure

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
            stages = "; ".join(
                f"{st['name']} {st['seconds']:.1f} s ({st['kernel_builds']} kernel builds)"
                for st in s.warmup.get("stages", [])
            )
            kc = s.warmup.get("kernel_cache") or {}
            cached = " / ".join(str(kc.get(k, "-")) for k in ("compiled", "found", "failed")) if kc else "-"
            starts.add_row(
                s.label, f"{s.load_to_ready_s:.1f}", str(s.warmup.get("seconds", "-")), stages or "-", cached
            )
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
    import statistics

    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"
