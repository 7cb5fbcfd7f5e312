"""Every cache kind answers to the protocol its users rely on: single rows to Cache, batches to BatchCache."""

import mlx.core as mx
import pytest

from engine.batch.runner import merge_rows
from engine.cache import BatchCache, BatchQuantizedKVCache, Cache, QuantizedKVCache
from engine.loading import load_model


@pytest.mark.parametrize("name", ["tiny-qwen35", "tiny-qwen3", "tiny-gemma3", "tiny-llama"])
def test_every_cache_kind_is_a_cache_and_its_batch_a_batch_cache(tiny_path, name):
    model = load_model(tiny_path(name))[0]
    singles = [model.make_cache() for _ in range(2)]
    assert all(isinstance(c, Cache) for c in singles[0]), [type(c).__name__ for c in singles[0]]
    batch = merge_rows(singles)
    assert all(isinstance(c, BatchCache) for c in batch), [type(c).__name__ for c in batch]
    model(mx.array([[1, 2, 3], [4, 5, 6]]), cache=batch)
    assert all(isinstance(c.extract(1), Cache) for c in batch)


def test_the_quantized_kinds_too():
    assert isinstance(QuantizedKVCache(group_size=32, bits=8), Cache)
    assert isinstance(BatchQuantizedKVCache([0, 0], group_size=32, bits=8), BatchCache)
