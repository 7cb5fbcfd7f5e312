"""The warm-up's early compilation of MLX's indexing kernels: one gather per dtype the model holds."""

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.indexing_warmup import INDEX_DTYPES, compile_indexing, model_dtypes


def test_a_gather_for_every_dtype_the_model_holds_by_each_index_dtype():
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))
    nn.quantize(model, group_size=32, bits=4)  # uint32 words, bf16-or-float32 scales
    dtypes = model_dtypes(model)
    assert mx.uint32 in dtypes and mx.float32 in dtypes
    assert compile_indexing(model) == len(dtypes) * len(INDEX_DTYPES) + 1  # and the padding roll's
