"""An LLM inference engine on MLX. `from engine import Engine` is the entry point."""


def __getattr__(name: str):
    # Lazy, so that light modules (registry, scheduler) import without MLX.
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
