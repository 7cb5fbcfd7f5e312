"""The device: the settings `engine serve` makes before loading (how much freed memory MLX keeps for reuse), and
the name results record it by."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

import mlx.core as mx

from engine.kernels import on_cuda

# the default --mlx-cache on CUDA: device memory MLX keeps after it is freed, for reuse, at most half the device.
# MLX's own limit is 95% of the device, which lets one server's freed buffers starve any other process on the GPU
# (a second server fails to load). MLX caches a freed buffer only while its cache is under the limit and evicts
# only under memory pressure, so once the warm-up's shapes fill a small cache, a lone row's buffers go to
# cudaMallocAsync / cudaFreeAsync every step: on an H200 (qwen27b) a lone request after the full warm-up decoded
# at 0.755x the `--batch 1` server's rate with 16 GiB and 0.934x with 64 GiB (docs/serving.md).
CUDA_MLX_CACHE = 64 << 30


# MLX's CUDA backend counts the misses of its caches (CUDA graph executables: 400 by default; cuDNN attention plans:
# 256) over the whole process and, with its check on, raises "Cache thrashing is happening" at the miss after twice
# a cache's capacity (mlx/backend/cuda/lru_cache.h; the string is in the 0.32.4 build). The count never resets, so in
# a server that runs for days the step that meets the 801st new graph topology, and every later one, would fail its
# requests. `engine serve` turns the check off unless it is set: a miss then costs one graph instantiation.
THRASHING_CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def serve_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """The MLX variables `engine serve` sets, unless given, before MLX reads them (its first device work)."""
    environ.setdefault(THRASHING_CHECK, "0")


def cuda_cache_limit(device_info: Mapping) -> int:
    """The default --mlx-cache on CUDA: CUDA_MLX_CACHE, at most half of the device's memory where MLX reports it."""
    total = device_info.get("total_memory") or device_info.get("memory_size")
    return min(CUDA_MLX_CACHE, int(total) // 2) if isinstance(total, int) and total > 0 else CUDA_MLX_CACHE


def limit_buffer_cache(limit: int | None) -> None:
    """MLX's buffer cache limit: `limit`, else `cuda_cache_limit` on CUDA (MLX's own elsewhere)."""
    if limit is None and on_cuda():
        limit = cuda_cache_limit(mx.device_info())
    if limit is not None:
        mx.set_cache_limit(limit)


def device_label() -> str:
    """MLX's default device and the name of the card (or CPU) it runs on, as results record it:
    `Device(gpu, 0) NVIDIA H100 80GB HBM3`, so figures from two kinds of card are not taken for one."""
    name = mx.device_info().get("device_name")
    return f"{mx.default_device()} {name}" if name else str(mx.default_device())
