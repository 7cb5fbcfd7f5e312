"""What every `harness` subcommand shares: the consoles, the user-error type, argument parsers, the options
several subcommands take (model source, artifact seed, results JSON, run database, kernel tier), and how verdicts
print."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from engine.kernels import AUTO, TIERS
from engine.model_source import resolve_model_dir

# Piped or captured (a log, CI): rich would wrap every line at 80 columns; lines are left whole (soft wrap) and
# tables get room to take their natural width.
console = Console(stderr=True)
if not console.is_terminal:
    console = Console(stderr=True, width=200, soft_wrap=True)
out = Console()
if not out.is_terminal:
    out = Console(width=200, soft_wrap=True)


class _Lines:
    """A status that prints each update as a line, with the seconds since it began."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def update(self, message: str) -> None:
        console.print(f"[{time.perf_counter() - self.start:.0f} s] {message}", markup=False, highlight=False)


@contextmanager
def status(text: str) -> Iterator:
    """A spinner with `text` on a terminal; elsewhere (a log, a pipe) each `update` as a line on stderr, so long
    work shows its progress where a spinner would print nothing."""
    if console.is_terminal:
        with console.status(text) as spinner:
            yield spinner
        return
    lines = _Lines()
    lines.update(text)
    yield lines


class CliError(ValueError):
    """Bad command-line input: printed without a traceback, exit code 2."""


def csv(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def csv_ints(value: str) -> list[int]:
    try:
        return [int(v) for v in csv(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return n


def at_least_two(value: str) -> int:
    n = int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(
            f"expected an integer >= 2 (a decode rate needs a gap between two tokens), got {value}"
        )
    return n


def non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return n


def float_type(ok, expected: str):
    """An argparse type: a float for which `ok` holds; otherwise the error says it expected `expected`."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return x

    return parse


positive_seconds = float_type(lambda s: 0 < s < float("inf"), "a positive number of seconds")
positive_float = float_type(lambda x: 0 < x < float("inf"), "a number above 0")
share = float_type(lambda x: 0 < x <= 1, "a share in (0, 1], e.g. 0.9")


def model_source(parser: argparse.ArgumentParser) -> None:
    """--models NAMES or --model-path DIR, one of them required."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--models", type=csv, help="registry names, comma-separated")
    src.add_argument("--model-path", type=Path, help="an mlx-lm model directory instead of a registry name")


def seed_option(parser: argparse.ArgumentParser, *, prompts: bool = False) -> None:
    """--seed N (default 0): the seed a registry model's artifact is synthesized from, and with `prompts` the seed
    of the prompts too."""
    what = "artifact and prompt seed of registry models" if prompts else "artifact seed of registry models"
    same = "" if prompts else "; the same name and seed give the same weights"
    parser.add_argument("--seed", type=int, default=0, help=f"{what} (default 0{same})")


def json_option(parser: argparse.ArgumentParser) -> None:
    """--json PATH: the results written there as JSON as well."""
    parser.add_argument("--json", type=Path, help="also write the results here")


DB = Path("reports/runs.sqlite")


def db_option(parser: argparse.ArgumentParser) -> None:
    """--db PATH: the run database (SQLite) that `harness run all` and `harness trials` write."""
    parser.add_argument("--db", type=Path, default=DB, help=f"the run database, SQLite (default {DB})")


def targets(args) -> list:
    """(label, model directory) for --models or --model-path."""
    if args.model_path:
        return [(str(args.model_path), resolve_model_dir(model_path=args.model_path))]
    return [(name, resolve_model_dir(model=name, seed=args.seed)) for name in args.models]


def measured_options(
    parser: argparse.ArgumentParser,
    *,
    prompt_tokens: int,
    decode_tokens: int,
    samples: int,
    unit: str,
    decode_type=positive,
) -> None:
    """The options of an in-process measurement: prompt and output length, measured and warmup `unit`s
    (requests per side, rounds, ...), the artifact and prompt seed, a JSON copy of the results."""
    least = ", at least 2" if decode_type is at_least_two else ""
    parser.add_argument(
        "--prompt-tokens",
        type=positive,
        default=prompt_tokens,
        help=f"prompt length per request (default {prompt_tokens})",
    )
    parser.add_argument(
        "--decode-tokens",
        type=decode_type,
        default=decode_tokens,
        help=f"tokens generated per request{least} (default {decode_tokens})",
    )
    parser.add_argument("--samples", type=positive, default=samples, help=f"measured {unit} (default {samples})")
    parser.add_argument("--warmup", type=int, default=1, help=f"warmup {unit} (default 1)")
    seed_option(parser, prompts=True)
    json_option(parser)


def kernels_option(parser: argparse.ArgumentParser, help: str) -> None:
    """--kernels auto|exact|fast (default auto): the engine side's kernel tier."""
    parser.add_argument("--kernels", choices=TIERS, default=AUTO, help=help)


def kernel_cache_option(parser: argparse.ArgumentParser) -> None:
    """--kernel-cache-dir DIR: the engine's CUDA kernels compiled into DIR ahead of MLX, in parallel."""
    parser.add_argument(
        "--kernel-cache-dir",
        type=Path,
        help="compile the engine's CUDA kernels into DIR ahead of MLX, in parallel, and load those compiled "
        "there before (MLX_PTX_CACHE_DIR; as engine serve --kernel-cache-dir): a first run compiles in parallel "
        "what MLX compiles one kernel at a time, a later one nothing (default: MLX compiles, nothing is kept)",
    )


def enable_kernel_cache(args) -> None:
    """The kernel cache `kernel_cache_option` asks for, before the command loads a model."""
    if args.kernel_cache_dir is not None:
        from engine.cli import enable_kernel_cache as enable

        try:
            enable(args.kernel_cache_dir)
        except ValueError as e:
            raise CliError(str(e)) from None


def verdict(passed: bool) -> str:
    return "[green]pass[/]" if passed else "[red]FAIL[/]"
