"""KV memory projection for admission (pure Python: the scheduler imports it).

A row's worst case is what its caches can hold once it has generated
max_tokens: growing KV layers grow in 256-token steps up to prompt +
max_tokens; rotating layers stop at their window; recurrent layers hold a
fixed state whatever the length. Padding that a short row pays beside a long
one is not in a row's projection (it is shared, and bounded by the longest).
"""

from __future__ import annotations

from dataclasses import dataclass

STEP = 256


@dataclass(frozen=True)
class LayerKV:
    kind: str  # "kv" | "rotating" | "recurrent"
    bytes_per_token: int = 0  # keys + values, all heads
    fixed_bytes: int = 0  # recurrent state
    window: int = 0  # rotating layers


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerKV, ...]

    def row_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """Worst-case bytes one row's caches reach."""
        tokens = prompt_tokens + max_tokens
        total = 0
        for layer in self.layers:
            if layer.kind == "kv":
                total += layer.bytes_per_token * (-(-tokens // STEP) * STEP)
            elif layer.kind == "rotating":
                total += layer.bytes_per_token * min(tokens, layer.window)
            else:
                total += layer.fixed_bytes
        return total
