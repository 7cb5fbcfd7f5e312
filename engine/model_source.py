"""Where a model comes from: a registry name (synthesized on first use) or a directory."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelSourceError
from engine.registry import get_spec
from engine.synth import ensure_model
from engine.synth.artifact import Progress


def resolve_model_dir(
    model: str | None = None,
    model_path: str | Path | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """The model directory for `--model NAME` or `--model-path DIR` (exactly one)."""
    if (model is None) == (model_path is None):
        raise ModelSourceError("give exactly one of a registry model name or --model-path DIR")
    if model_path is not None:
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is not an mlx-lm model directory (no config.json)")
        return path
    get_spec(model)  # raises UnknownModelError with the list of known names
    return ensure_model(model, seed=seed, progress=progress)
