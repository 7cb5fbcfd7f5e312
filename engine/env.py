"""The few environment variables the project reads, parsed in one place.

Every benchmark run records `snapshot()` so a result can be traced to the
settings it ran under.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT = "engine-harness"

_VARS = {
    "ENGINE_HARNESS_CACHE": "where synthesized models live (default ~/.cache/engine-harness)",
}


def cache_root() -> Path:
    root = os.environ.get("ENGINE_HARNESS_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / PROJECT


def models_dir() -> Path:
    return cache_root() / "models"


def snapshot() -> dict[str, str]:
    """The project's environment variables that are set, for run provenance."""
    return {k: os.environ[k] for k in _VARS if k in os.environ}
