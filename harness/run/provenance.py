"""Where a result came from: machine, software, source tree, environment."""

from __future__ import annotations

import hashlib
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import psutil

from engine import env

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str:
    if shutil.which("nvidia-smi"):
        return _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return ""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def source_tree_sha256(exclude: Sequence[Path] = ()) -> str:
    """Hash of every tracked and untracked-but-not-ignored file as it is on disk (uncommitted edits count), but
    `exclude` (a run's own outputs, which it rewrites while it runs)."""
    files = _run(["git", "ls-files", "--cached", "--others", "--exclude-standard"]).splitlines()
    skip = {Path(p).resolve() for p in exclude}
    h = hashlib.sha256()
    for name in sorted(files):
        path = ROOT / name
        if path.is_file() and path.resolve() not in skip:
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def collect(exclude: Sequence[Path] = ()) -> dict:
    """The machine, the software and the source tree (`source_tree_sha256(exclude)`)."""
    return {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": psutil.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "gpu": _gpu(),
        "mlx_device": str(mx.default_device()),
        "python": sys.version.split()[0],
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "git_commit": _run(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(_run(["git", "status", "--porcelain"])),
        "source_tree_sha256": source_tree_sha256(exclude),
        "environment": env.snapshot(),
    }


def manifest_sha256(model_dir: Path) -> str:
    path = model_dir / "manifest.json"
    if not path.exists():  # a real model directory: hash its config and weight index instead
        parts = [p for p in (model_dir / "config.json", model_dir / "model.safetensors.index.json") if p.exists()]
        return hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()
