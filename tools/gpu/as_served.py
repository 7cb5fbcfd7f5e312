"""This process's device set up as `engine serve` sets it up, for the tools that run its lanes in process."""

from __future__ import annotations


def prepare_device() -> None:
    """The compiled-kernel cache (MLX_PTX_CACHE_DIR, set before MLX compiles anything) and, on CUDA, the engine's
    kernel builds cached there and MLX's buffer cache bounded as `engine serve` bounds it. Call it before the first
    MLX operation."""
    from engine.cli import use_kernel_cache

    directory = use_kernel_cache(None)

    import mlx.core as mx

    from engine.device import CUDA_MLX_CACHE
    from engine.kernels import on_cuda
    from engine.kernels.cuda_source import BUILDS

    if on_cuda():
        BUILDS.enable_cache(directory)
        mx.set_cache_limit(CUDA_MLX_CACHE)
