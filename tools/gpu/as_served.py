"""This process's device set up as `engine serve` sets it up, for the tools that run its lanes in process."""

from __future__ import annotations


def prepare_device() -> None:
    """The compiled-kernel cache (MLX_PTX_CACHE_DIR, set before MLX compiles anything), the MLX variables `engine
    serve` sets (`serve_environment`) and, on CUDA, the engine's kernel builds cached there and MLX's buffer cache
    bounded as `engine serve` bounds it. Call it before the first MLX operation."""
    from engine.cli import use_kernel_cache

    directory = use_kernel_cache(None)

    import mlx.core as mx

    from engine.device import CUDA_MLX_CACHE, serve_environment
    from engine.kernels import on_cuda
    from engine.kernels.cuda_source import BUILDS

    serve_environment()
    if on_cuda():
        BUILDS.enable_cache(directory)
        mx.set_cache_limit(CUDA_MLX_CACHE)


def warmed_gateway(model: str | None, model_path: str | None, warmup: str, serve=None, log=None):
    """The model loaded and a Gateway on it as `engine serve` builds one (`serve`: its ServeConfig, default the
    server's defaults), warmed up with `warmup`, then Python's garbage and MLX's buffer cache emptied as the
    server empties them before it reports ready. After `prepare_device`. Returns (engine, gateway, seconds the
    warm-up took)."""
    import gc
    import time

    import mlx.core as mx

    from engine.engine import Engine
    from engine.gateway import Gateway
    from engine.loading import context_of
    from engine.server.main import ServeConfig
    from engine.warmup import warm_up

    serve = serve or ServeConfig()
    engine = Engine.load(model, model_path)
    gateway = Gateway(engine.model, serve.gateway_config(engine.kernels.tier), builds=engine.kernels.builds)
    start = time.perf_counter()
    warm_up(gateway, warmup, context=context_of(engine.config), log=log or (lambda line: None))
    gc.collect()
    mx.clear_cache()
    return engine, gateway, time.perf_counter() - start
