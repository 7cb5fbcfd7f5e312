"""`harness`: the benchmark and parity harness.

harness models list                      registry, geometry, size, cache state
harness models synth NAME [--seed S]     write a synthetic mlx-lm artifact
harness parity [--models ...]            live oracle gate against mlx-lm
harness native --models NAME             in-process speed: engine vs mlx-lm
harness server-overhead --models NAME    in-process vs through `engine serve`
harness startup --models NAME            load to ready, bursts after ready, lone vs serial, restart
harness kernels [--shapes qwen27b]       fast-tier kernels vs MLX's ops; --gate-model: numerics gate
harness quality --models NAME            held-out perplexity, KL vs reference: weight bits, KV bits, tiers
harness run all [--models ...]           the benchmark: real servers, frozen workloads, JSON + SQLite
harness trials --arms A,B --seeds 5      paired blocks for A-vs-B claims
harness report A.json [B.json] --out compare.html   offline HTML comparison
harness db list | export RUN_ID          the run database
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.errors import USER_ERRORS
from harness import (
    batch_bench_cli,
    kernels_cli,
    models_cli,
    native_cli,
    parity_cli,
    quality_cli,
    report_cli,
    run_cli,
    server_overhead_cli,
    spec_cli,
    startup_cli,
    workloads_cli,
)
from harness.cli_common import CliError, console


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser, each from its own module (`harness/*_cli.py`)."""
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Benchmark and parity harness for the engine, with stock mlx-lm as the reference.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models_cli.add_models(sub)
    parity_cli.add_parity(sub)
    native_cli.add_native(sub)
    batch_bench_cli.add_batch_bench(sub)
    server_overhead_cli.add_server_overhead(sub)
    startup_cli.add_startup(sub)
    workloads_cli.add_workloads(sub)
    report_cli.add_report(sub)
    report_cli.add_db(sub)
    spec_cli.add_spec(sub)
    kernels_cli.add_kernels(sub)
    quality_cli.add_quality(sub)
    run_cli.add_run(sub)
    run_cli.add_trials(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
