"""The prompt cache holds the bytes it reports: entries own their arrays and keep nothing of the batch alive."""

import gc

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.cache import BatchKVCache, KVCache, RecurrentCache, own
from engine.gateway import Gateway, GatewayConfig
from engine.loading import load_model
from engine.request import GenerationRequest, StopCriteria
from engine.sinks import CollectingSink

# Arrays outside the model and the cache entries: measured at 8 bytes after serving with
# the prompt cache off (the runner and the samplers keep nothing between requests); 1 MiB
# leaves room for the allocator's rounding, which is < 2 pages per array and tiny next to
# the entries' arrays here (prompts of 150-300 tokens).
ALLOWANCE_BYTES = 1 << 20


def settled_active_bytes() -> int:
    """MLX active memory once in-flight work is done and freed buffers are no longer cached."""
    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def held_arrays(obj):
    """Every array a cache object holds, whatever attribute it sits in."""
    if isinstance(obj, mx.array):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from held_arrays(x)
    elif hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from held_arrays(x)


def distinct_prompt(i: int) -> tuple[int, ...]:
    n = 150 + (37 * i) % 151
    return (1000 + i,) + tuple((7 * i + 3 * k) % 900 + 1 for k in range(n - 1))


@pytest.mark.parametrize("name", ["tiny-qwen3-f32", "tiny-qwen35"])
def test_reported_prompt_cache_bytes_bound_mlx_active_memory(name, tiny_path):
    base = settled_active_bytes()  # what tests before this one in the process still hold
    model = load_model(tiny_path(name))[0]
    model_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    budget = 40 << 20  # smaller than what the requests leave, so entries are also evicted
    g = Gateway(model, GatewayConfig(batch=8, prompt_cache_bytes=budget))
    sinks = []
    for i in range(200):
        sinks.append(CollectingSink())
        stop = StopCriteria(max_tokens=2 + i % 5, ignore_eos=True)
        g.submit(GenerationRequest(f"r{i}", distinct_prompt(i), stop=stop), sinks[-1])
        if i % 16 == 15:
            g.run_until_idle()
    g.run_until_idle()
    assert all(s.result.finish_reason.value == "length" for s in sinks)

    active = settled_active_bytes() - base
    stats = g.prompt_cache.stats()
    entries = list(g.prompt_cache._entries.values())
    stored = sum(a.nbytes for e in entries for a in held_arrays([e.cache, list(e.snapshots.values())]))
    print(
        f"{name}: reported {stats.bytes:,} stored {stored:,} entries {stats.entries} "
        f"active {active:,} model {model_bytes:,}"
    )
    assert stats.bytes == stored
    assert stats.entries < 200 * (2 if name == "tiny-qwen35" else 1)  # the budget evicted some
    assert 0.8 * budget < stats.bytes <= budget
    expected = stats.bytes + model_bytes + ALLOWANCE_BYTES
    assert abs(active - expected) <= 0.10 * expected, (active, expected)


@pytest.mark.parametrize("kind", ["kv", "recurrent"])
def test_an_extracted_row_keeps_nothing_of_the_batch(kind):
    """A row taken from a batch owns buffers of its own size: dropping the batch frees all the rest.

    The rows here are small next to their batch buffers (within MLX's 16 KiB, where mx.contiguous
    of a slice keeps the source buffer) and the filtered KV parts are views of larger buffers.
    """
    base = settled_active_bytes()
    if kind == "kv":
        batch = BatchKVCache([3, 0, 5])
        batch.update_and_fetch(mx.ones((3, 2, 40, 64)), mx.ones((3, 2, 40, 64)))
        batch.filter([0, 2])  # drops the shared padding: the parts become views
    else:
        batch = RecurrentCache()
        batch.slots = [mx.ones((3, 3, 64)), mx.ones((3, 4, 16, 16))]  # rows of 768 and 4,096 bytes
    mx.eval(batch.state)
    row = batch.extract(1)
    own([[row]])  # what every extractor does: the copies evaluated, in one call
    del batch
    row_bytes = sum(a.nbytes for a in held_arrays(row))
    assert settled_active_bytes() == base + row_bytes
    if kind == "kv":
        assert isinstance(row, KVCache) and row.offset == row.keys.shape[2] == 35
