"""Per-layer caches: growing KV, rotating KV, recurrent state and quantized KV."""

import mlx.core as mx

from engine.cache.batch_kv import BatchKVCache
from engine.cache.batch_quantized import BatchQuantizedKVCache
from engine.cache.batch_rotating import BatchRotatingKVCache
from engine.cache.kv import KVCache
from engine.cache.protocols import BatchCache, Cache
from engine.cache.quantized import QuantizedKVCache
from engine.cache.recurrent import RecurrentCache
from engine.cache.rotating import RotatingKVCache


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


def cache_arrays(cache: list) -> list:
    """Every array the caches hold, for mx.eval after a prefill chunk."""
    return [c.state for c in cache]


def with_rows(cache: list | None, joined: list) -> list:
    """A batch's per-layer caches with `joined`'s rows appended as its last rows (in place); with no batch yet
    (None), `joined` is the batch."""
    if cache is None:
        return joined
    for running, joiner in zip(cache, joined):
        running.extend(joiner)
    return cache


def kept_rows(cache: list | None, keep: list[int]) -> list | None:
    """A batch's per-layer caches holding only rows `keep`, in this order (in place); None when no row stays,
    so the next joiners start a fresh batch."""
    if not keep or cache is None:
        return None
    for c in cache:
        c.filter(keep)
    return cache


def own(caches) -> None:
    """Evaluate extracted caches (lists of caches, None for a layer left out), asynchronously and in one
    call, so that their copies let go of the batch they were sliced from (`kv.owned_copies`)."""
    mx.async_eval([c.state for layers in caches for c in layers if c is not None])


__all__ = [
    "BatchCache",
    "BatchKVCache",
    "BatchQuantizedKVCache",
    "BatchRotatingKVCache",
    "Cache",
    "KVCache",
    "QuantizedKVCache",
    "RecurrentCache",
    "RotatingKVCache",
    "cache_arrays",
    "own",
    "cache_nbytes",
    "kept_rows",
    "with_rows",
]
