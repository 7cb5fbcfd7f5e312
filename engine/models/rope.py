"""Rotary position embeddings from a config's rope settings."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class Llama3RoPE(nn.Module):
    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        freqs = base ** (mx.arange(0, dims, 2) / dims)
        wavelens = 2 * mx.pi * freqs
        freqs = mx.where(wavelens > old_len / low, freqs * factor, freqs)
        is_medium = (wavelens > old_len / high) & (wavelens < old_len / low)
        smooth = (old_len / wavelens - low) / (high - low)
        smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
        self._freqs = mx.where(is_medium, smooth_freqs, freqs)

    def __call__(self, x, offset=0):
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def make_rope(dims: int, base: float, traditional: bool = False, scaling: dict | None = None) -> nn.Module:
    kind = "default"
    if scaling is not None:
        kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind in ("default", "linear", "mrope"):
        scale = 1 / scaling["factor"] if kind == "linear" else 1.0
        return nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    if kind == "llama3":
        return Llama3RoPE(dims, base, traditional, scaling)
    raise ValueError(f"rope type {kind!r} is not supported by this engine")
