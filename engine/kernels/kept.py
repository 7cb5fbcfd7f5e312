"""Dense copies of the fast tier's weights kept within the memory a server has left (`KernelConfig.keep_dense_auto`).

A dense prompt chunk dequantizes every matrix it multiplies, whatever its rows: on qwen27b ~45-55 ms a forward
(docs/kernels.md, "Prefill"). Copies made once save that, for 2 bytes a weight (54 GB beside qwen27b's 15 GB of
4-bit weights). Made at load, all of them, a server ran out of device memory in its warm-up; made after it, the
warm-up's peak (weights, caches, the largest forwards it ran) is known, and the copies take what MLX's memory
limit leaves above it and a margin, matrix after matrix in the model's order (each saves its dequantization's
time, the same per byte).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.quantized_gemv.layer import KernelQuantizedLinear

MARGIN = 0.10  # of MLX's memory limit left free beside the warm-up's peak and the copies


@dataclass(frozen=True)
class Kept:
    """What `keep_within` kept: its budget, the matrices and bytes kept, of the dense path's matrices in all."""

    budget: int
    matrices: int
    bytes: int
    candidates: int
    candidate_bytes: int

    def as_record(self) -> dict:
        return asdict(self)

    def copies(self) -> str:
        """What was kept, of what could be."""
        gb = 1e9
        return (
            f"kept dense copies of {self.matrices} of {self.candidates} matrices "
            f"({self.bytes / gb:.1f} of {self.candidate_bytes / gb:.1f} GB)"
        )

    def line(self) -> str:
        return f"{self.copies()} within {self.budget / 1e9:.1f} GB"


def budget(limit: int, peak: int, reserve: int = 0) -> int:
    """Bytes the copies may take: MLX's memory `limit` less the `peak` so far (weights and the warm-up's largest
    working set), a MARGIN of the limit and `reserve` (a KV budget not yet spent), never below 0."""
    return max(0, limit - peak - int(MARGIN * limit) - reserve)


def dense_bytes(q: KernelQuantizedLinear) -> int:
    """A matrix's dequantized copy: outputs x inputs in its scales' dtype."""
    rows, words = q["weight"].shape
    return rows * words * 32 // q.bits * q["scales"].dtype.size


def keep_within(model: nn.Module, limit: int) -> Kept:
    """Dense copies of the model's dense-path matrices, in its order, while they fit in `limit` bytes (those kept
    already count first); each made and evaluated before the next, so none waits to be freed."""
    layers = [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear) and m.dense_prefill]
    used = sum(dense_bytes(q) for q in layers if q.kept is not None)
    for q in layers:
        size = dense_bytes(q)
        if q.kept is None and used + size <= limit:
            mx.eval(q.keep_dense().weight)
            used += size
    kept = [q for q in layers if q.kept is not None]
    return Kept(limit, len(kept), used, len(layers), sum(dense_bytes(q) for q in layers))
