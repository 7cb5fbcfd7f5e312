"""Read a loaded model's KV layout (per layer: kind and bytes) for the scheduler's budget."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.batch.kv_budget import KVLayout, LayerKV
from engine.cache import KVCache, RecurrentCache, RotatingKVCache
from engine.generate import KVQuantization


def activation_itemsize(model: nn.Module) -> int:
    """Bytes per element of the activations (and so of the KV cache)."""
    for name, module in model.named_modules():
        if name.endswith("embed_tokens"):
            ref = module.scales if isinstance(module, nn.QuantizedEmbedding) else module.weight
            return ref.dtype.size
    return mx.float32.size


def kv_layout(model: nn.Module, kv: KVQuantization | None = None) -> KVLayout:
    """Per-layer KV bytes; with `kv`, growing layers store affine codes plus scales and biases."""
    itemsize = activation_itemsize(model)
    layers = []
    for layer, cache in zip(model.layers, model.make_cache()):
        if isinstance(cache, RecurrentCache):
            layers.append(LayerKV("recurrent", fixed_bytes=layer.linear_attn.state_bytes(itemsize)))
            continue
        dims = layer.self_attn.kv_channels
        per_token = dims * itemsize
        if kv is not None and isinstance(cache, KVCache):
            per_token = dims * kv.bits // 8 + 2 * (dims // kv.group_size) * itemsize
        if isinstance(cache, RotatingKVCache):
            layers.append(LayerKV("rotating", bytes_per_token=per_token, window=cache.max_size))
        elif isinstance(cache, KVCache):
            layers.append(LayerKV("kv", bytes_per_token=per_token))
        else:
            raise TypeError(f"no KV projection for cache type {type(cache).__name__}")
    return KVLayout(tuple(layers))
