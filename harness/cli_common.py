"""What every `harness` subcommand shares: the consoles, the user-error type, argument parsers."""

from __future__ import annotations

import argparse

from rich.console import Console

console = Console(stderr=True)
out = Console()
if not out.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
    out = Console(width=200)


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
        raise argparse.ArgumentTypeError(f"expected an integer >= 2 (a decode rate needs a gap between two tokens), got {value}")
    return n


def non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return n


def positive_seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not s > 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value}")
    return s
