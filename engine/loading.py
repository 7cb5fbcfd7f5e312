"""Load a model directory (mlx-lm's format) into the engine's own model classes.

Weights load exactly as mlx-lm loads them: every model*.safetensors file,
the model's `sanitize`, then affine quantization of each Linear/Embedding
whose `.scales` are present, with bits and group size read off the packed
shapes. Identical arrays in, so identical logits out.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import ModelLoadError
from engine.models import model_module


def load_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json; is it an mlx-lm model directory?")
    config = json.loads(config_file.read_text())
    gen_file = path / "generation_config.json"
    if gen_file.exists():
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        if eos:
            config["eos_token_id"] = eos
    if "quantization_config" not in config and "quantization_config" in config.get("text_config", {}):
        config["quantization_config"] = config["text_config"]["quantization_config"]
    return config


def text_config(config: dict) -> dict:
    """The language model's settings: nested under text_config in multimodal layouts (Qwen3.5)."""
    return config.get("text_config", config)


def vocab_size(config: dict) -> int:
    """Rows of the embedding: every valid token id is below this."""
    return int(text_config(config).get("vocab_size") or config["vocab_size"])


def context_of(config: dict) -> int:
    """The model's context length: its max_position_embeddings (4096 where it names none)."""
    return int(text_config(config).get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)


def _quant_params(path: str, module: nn.Module, weights: dict) -> dict[str, Any]:
    scales = weights[f"{path}.scales"]
    in_dims = module.weight.shape[-1]
    group_size = in_dims // scales.shape[-1]
    bits = (weights[f"{path}.weight"].shape[-1] * 32) // in_dims
    if scales.dtype == mx.uint8:
        raise ModelLoadError(f"{path}: only affine quantization is supported (found a microscaling format)")
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def _quantize(model: nn.Module, quantization: dict[str, Any], weights: dict) -> None:
    if quantization.get("mode", "affine") != "affine":
        raise ModelLoadError(f"quantization mode {quantization['mode']!r} is not supported (affine only)")

    def predicate(path: str, module: nn.Module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return _quant_params(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode="affine",
        class_predicate=predicate,
    )


def load_model(path: str | Path, lazy: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """Build the engine model for a directory and load its weights.

    With `lazy=True` the arrays stay memory-mapped until first use (a 27B
    model's shapes and config can be checked without reading 15 GB).
    """
    path = Path(path)
    config = load_config(path)
    module = model_module(config.get("model_type", ""))
    model = module.Model(module.ModelArgs.from_dict(config))
    files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise ModelLoadError(f"no model*.safetensors files in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(f))
    weights = model.sanitize(weights)
    quantization = config.get("quantization")
    if quantization is None and config.get("quantization_config", {}).get("quant_method"):
        raise ModelLoadError(f"quantization method {config['quantization_config']['quant_method']!r} is not supported")
    if quantization is not None:
        _quantize(model, quantization, weights)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    return model, config
