"""Model implementations, one module per config.json model_type."""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import UnsupportedModelError

_MODULES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "gemma3_text": "gemma3_text",
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_MODULES))


def model_module(model_type: str) -> ModuleType:
    name = _MODULES.get(model_type)
    if name is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return importlib.import_module(f"engine.models.{name}")
