"""The arms a benchmark compares: real server processes on the same artifact.

    engine         `engine serve` at its defaults (continuous batching, prompt cache)
    engine-serial  `engine serve --batch 1` (every request on the strict serial path)
    mlx-lm         stock `mlx_lm.server` through oracles/mlx_lm_server.py, which adds
                   only token-id prompts and `ignore_eos` (see that file)

Every arm gets the same request body; `extra_body` adds what only that arm
understands (our server refuses unknown fields, mlx-lm ignores them).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from harness.servers import engine_serve_command

Command = Callable[[Path, int], list[str]]


@dataclass(frozen=True)
class ArmSpec:
    name: str
    command: Command  # (model directory, port) -> argv
    extra_body: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    probe: Optional[dict] = None  # a completion that must succeed before the arm counts as ready
    returns_token_ids: bool = False


def _hf_env() -> dict[str, str]:
    # mlx_lm.server's /v1/models fails without an existing Hugging Face cache folder; stay offline.
    cache = Path(tempfile.gettempdir()) / "engine-harness-hf-cache"
    cache.mkdir(exist_ok=True)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def standard_arms() -> dict[str, ArmSpec]:
    ours = {"return_token_ids": True}
    return {
        "engine": ArmSpec("engine", lambda d, p: engine_serve_command(["--model-path", str(d)], p), ours,
                          returns_token_ids=True),
        "engine-serial": ArmSpec("engine-serial",
                                 lambda d, p: engine_serve_command(["--model-path", str(d)], p, "--batch", "1"),
                                 ours, returns_token_ids=True),
        "mlx-lm": ArmSpec("mlx-lm", lambda d, p: [sys.executable, "-m", "oracles.mlx_lm_server", "--model", str(d),
                                                  "--host", "127.0.0.1", "--port", str(p)],
                          env=_hf_env(), probe={"prompt": [5, 6, 7], "max_tokens": 1}),
    }  # fmt: skip


def resolve_arms(names: list[str], known: Optional[dict[str, ArmSpec]] = None) -> list[ArmSpec]:
    known = known or standard_arms()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]
