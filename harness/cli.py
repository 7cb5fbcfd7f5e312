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
from harness import models
from harness.bench import cli as bench
from harness.cli_common import CliError, console
from harness.gates import cli as gates
from harness.kernels import cli as kernels
from harness.report import cli as report
from harness.run import cli as run


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser, each from the `cli` module of its package (`harness/*/cli.py`)."""
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Benchmark and parity harness for the engine, with stock mlx-lm as the reference.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    models.add_models(sub)
    gates.add_parity(sub)
    bench.add_native(sub)
    bench.add_batch_bench(sub)
    bench.add_server_overhead(sub)
    bench.add_startup(sub)
    run.add_workloads(sub)
    report.add_report(sub)
    report.add_db(sub)
    bench.add_spec(sub)
    kernels.add_kernels(sub)
    gates.add_quality(sub)
    run.add_run(sub)
    run.add_trials(sub)
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
