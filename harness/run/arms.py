"""The arms a benchmark compares: real server processes on the same artifact.

    engine         `engine serve` at its defaults (continuous batching, prompt cache, kernels auto: fast on CUDA
                   where the numerics gate passed)
    engine-serial  `engine serve --batch 1` (every request on the strict serial path)
    engine-exact   `engine serve --kernels exact` (MLX's operations, bit-exact with mlx-lm)
    engine-fast    `engine serve --kernels fast` (custom CUDA kernels; off CUDA the server runs exact
                   and says so: each run records the tier the server reports in /stats, not the flag)
    mlx-lm         stock `mlx_lm.server` through oracles/mlx_lm_server.py, which adds
                   only token-id prompts, `ignore_eos` and a listen backlog (see that file)
    engine-NAME    `engine serve` with the options `--arm-args 'engine-NAME=OPTIONS'` gives (a variant
                   of the engine arm: `engine-spec=--draft-kind ngram`, say)
    NAME=URL       (`--arm`) an OpenAI-compatible server the harness did not start: vLLM, llama-server,
                   another `engine serve`; measured through its URL, every request naming its first model

Every arm gets the same request body; `extra_body` adds what only that arm
understands (our server refuses unknown fields, mlx-lm ignores them).
"""

from __future__ import annotations

import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.kernels import EXACT, FAST
from harness.run.servers import engine_serve_command

Command = Callable[[Path, int], list[str]]


@dataclass(frozen=True)
class ArmSpec:
    name: str
    command: Command  # (model directory, port) -> argv
    extra_body: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    probe: dict | None = None  # a completion that must succeed before the arm counts as ready
    returns_token_ids: bool = False
    is_engine: bool = False  # an `engine serve` arm: its /stats says which kernel tier runs
    url: str | None = None  # a server the harness did not start (`external_arm`): no command to run


def _hf_env() -> dict[str, str]:
    # mlx_lm.server's /v1/models fails without an existing Hugging Face cache folder; stay offline.
    cache = Path(tempfile.gettempdir()) / "engine-harness-hf-cache"
    cache.mkdir(exist_ok=True)
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _engine_arm(name: str, *flags: str) -> ArmSpec:
    def command(model_dir: Path, port: int) -> list[str]:
        return engine_serve_command(["--model-path", str(model_dir)], port, *flags)

    return ArmSpec(name, command, {"return_token_ids": True}, returns_token_ids=True, is_engine=True)


def standard_arms() -> dict[str, ArmSpec]:
    return {
        "engine": _engine_arm("engine"),
        "engine-serial": _engine_arm("engine-serial", "--batch", "1"),
        **{f"engine-{tier}": _engine_arm(f"engine-{tier}", "--kernels", tier) for tier in (EXACT, FAST)},
        # n-gram speculation as spec rows in the continuous batch (engine serve --spec-batch)
        "engine-spec": _engine_arm("engine-spec", "--draft-kind", "ngram", "--spec-batch"),
        "mlx-lm": ArmSpec(
            "mlx-lm",
            lambda d, p: [
                sys.executable,
                "-m",
                "oracles.mlx_lm_server",
                "--model",
                str(d),
                "--host",
                "127.0.0.1",
                "--port",
                str(p),
            ],
            env=_hf_env(),
            probe={"prompt": [5, 6, 7], "max_tokens": 1},
        ),
    }


def with_options(arm: ArmSpec, options: list[str]) -> ArmSpec:
    """The arm with `options` appended to its server's command line (a later flag wins over the arm's own)."""
    base = arm.command
    return replace(arm, command=lambda model_dir, port: base(model_dir, port) + list(options))


def parse_arm_options(items: list[str]) -> dict[str, list[str]]:
    """--arm-args values, 'ARM=OPTIONS' each (OPTIONS split as a shell would), as {arm: options}; ValueError
    for an item without '=' or an arm named twice."""
    parsed: dict[str, list[str]] = {}
    for item in items:
        name, sep, options = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--arm-args {item!r}: give ARM=OPTIONS, e.g. 'engine=--batch 64'")
        if name.strip() in parsed:
            raise ValueError(f"--arm-args names {name.strip()} twice")
        parsed[name.strip()] = shlex.split(options)
    return parsed


def external_arm(item: str) -> ArmSpec:
    """An --arm value, NAME=URL (http or https), as an arm the harness measures but does not start."""
    name, sep, url = item.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--arm {item!r}: give NAME=URL, e.g. vllm=http://127.0.0.1:8000")
    if name in standard_arms() or name.startswith("engine-"):
        raise ValueError(f"--arm {name}: a name the harness's own arms use; choose another")
    return ArmSpec(name, lambda d, p, url=url: ["(external)", url], url=url)


def resolve_arms(
    names: list[str],
    known: dict[str, ArmSpec] | None = None,
    options: dict[str, list[str]] | None = None,
    external: Sequence[ArmSpec] = (),
) -> list[ArmSpec]:
    """The arms by name, each with its server `options` (`parse_arm_options`) appended, then the `external` ones
    that `names` does not place (a name an external arm has stands for it: `--arms ext --arm ext=URL`, or no names
    and only external arms); an `engine-NAME` arm that is not a standard one is the engine arm with its options (a
    variant). ValueError for an unknown arm, a variant without options, or options for an arm not run."""
    known = dict(known or standard_arms()) | {a.name: a for a in external}
    options = options or {}
    for n in names:
        if n not in known and n.startswith("engine-") and n in options:
            known[n] = _engine_arm(n)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(known)} (an engine variant "
            "engine-NAME needs --arm-args 'engine-NAME=OPTIONS'; another server, --arm NAME=URL)"
        )
    idle = [n for n in options if n not in names]
    if idle:
        raise ValueError(f"--arm-args for {', '.join(idle)}, which this run does not run (--arms {','.join(names)})")
    started_elsewhere = [a.name for a in external if a.name in options]
    if started_elsewhere:
        raise ValueError(
            f"--arm-args for {', '.join(started_elsewhere)}: a server the harness did not start takes no server options"
        )
    arms = [with_options(known[n], options[n]) if n in options else known[n] for n in names]
    return arms + [a for a in external if a.name not in names]
