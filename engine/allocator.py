"""The host's memory allocator for `engine serve`: mimalloc in place of glibc's malloc, where installed.

Building and submitting a decode step allocates and frees a few small C++ objects for every graph node (arrays,
their shapes, the compiled calls' replays), and glibc's malloc spends a third of the host thread's time there
(perf, CPU). mimalloc (the `cmeel-mimalloc` package's library, loaded by LD_PRELOAD) takes 20-30% off an MLX
operation's host time on CUDA and a third off a one-row step's build on the CPU, and does not slow as the process
traces more shapes, as glibc's does (docs/kernels.md, "Host cost"). An allocator can only be chosen before the
process starts, so `engine serve` started as a command runs itself again with LD_PRELOAD set (`reexec`).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

CHOICES = ("auto", "mimalloc", "system")
MARK = "ENGINE_ALLOCATOR_SET"  # set in the environment of the process `reexec` starts: it never starts another
PURGE = "MIMALLOC_PURGE_DELAY"  # ms before mimalloc returns freed memory to the system


def mimalloc_path() -> Path | None:
    """libmimalloc.so from the `cmeel-mimalloc` package, or None where it is not installed."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmimalloc.so"):
            path = Path(f.locate())
            if path.exists():
                return path
    return None


def loaded() -> str:
    """The allocator this process runs on: 'mimalloc' where its library is mapped, else 'system'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in maps else "system"


def preload_env(choice: str, path: Path | None, env: dict[str, str]) -> dict[str, str] | None:
    """The environment to run this process again in so that it loads mimalloc, or None to go on as it is: the
    choice is `system`, or this process is the one run again (`MARK`; whether mimalloc is loaded already,
    `reexec` asks first). `auto` without the library goes on with the system's; `mimalloc` without it is an
    error."""
    if choice not in CHOICES:
        raise ValueError(f"--allocator must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "system" or env.get(MARK):
        return None
    if path is None:
        if choice == "mimalloc":
            raise ValueError("--allocator mimalloc: the cmeel-mimalloc package is not installed")
        return None
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    # freed pages back to the system at once, not after mimalloc's default 10 ms: its RSS stays the system
    # allocator's (CPU server: ~+12% otherwise; H100 server +0.8 GB), its build times unchanged; a value the
    # environment gives stands
    purge = env.get(PURGE, "0")
    return {**env, "LD_PRELOAD": ":".join([str(path), *preload]), PURGE: purge, MARK: "1"}


def reexec(choice: str, argv: list[str]) -> None:
    """Run `python -m engine *argv` in this process's place with mimalloc preloaded, where `preload_env` says so
    (Linux only; returns where there is nothing to do)."""
    if not sys.platform.startswith("linux") or loaded() == "mimalloc":
        return
    env = preload_env(choice, mimalloc_path(), dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "engine", *argv], env)
