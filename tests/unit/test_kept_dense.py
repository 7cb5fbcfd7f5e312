"""Dense copies kept within a memory budget (`engine.kernels.kept`, ENGINE_KEEP_DENSE=auto)."""

from dataclasses import replace

import mlx.core as mx

from engine.engine import Engine
from engine.kernels import EXACT, FAST, KernelConfig, install
from engine.kernels.kept import MARGIN, budget, dense_bytes, keep_within
from engine.kernels.quantized_gemv.layer import KernelQuantizedLinear


def _dense_model():
    """tiny-qwen35-4bit on the fast tier with every matrix on the dense path from 8 rows (a stand-in launch
    computing MLX's product, so it runs on any backend)."""
    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    launch = lambda x, layers, **_: tuple(q.mlx_matmul(x) for q in layers)  # noqa: E731
    install(model, KernelConfig(FAST, gemv_stand_in=launch, gemv_min_outputs=0, dense_min_rows=8, force=True))
    return model


def _dense_layers(model):
    return [m for _, m in model.named_modules() if isinstance(m, KernelQuantizedLinear) and m.dense_prefill]


def test_the_budget_is_the_memory_limit_less_the_peak_a_margin_and_the_kv_reserve():
    assert budget(1000, 400) == 1000 - 400 - int(MARGIN * 1000)
    assert budget(1000, 400, reserve=100) == budget(1000, 400) - 100
    assert budget(1000, 950) == 0  # past the limit: nothing kept


def test_copies_are_kept_in_the_model_s_order_while_they_fit():
    model = _dense_model()
    layers = _dense_layers(model)
    assert layers and all(q.kept is None for q in layers)
    sizes = [dense_bytes(q) for q in layers]
    assert sizes[0] == layers[0]["weight"].shape[0] * layers[0]["weight"].shape[1] * 8 * 2  # 4-bit, bf16 copy

    none = keep_within(model, 0)
    assert (none.matrices, none.bytes, none.candidates) == (0, 0, len(layers))
    two = keep_within(model, sizes[0] + sizes[1])
    assert [q.kept is not None for q in layers[:3]] == [True, True, sizes[2] == 0]
    assert two.bytes == sizes[0] + sizes[1] <= two.budget
    assert keep_within(model, sizes[0] + sizes[1]).matrices == two.matrices  # those kept count first: no more
    everything = keep_within(model, sum(sizes))
    assert everything.matrices == len(layers) and everything.bytes == everything.candidate_bytes == sum(sizes)
    assert "of" in everything.line() and everything.as_record()["matrices"] == len(layers)
    install(model, KernelConfig(EXACT))  # a re-install drops the copies
    assert not any(getattr(m, "kept", None) is not None for _, m in model.named_modules())


def test_a_model_with_some_copies_kept_prefills_the_same_logits():
    model = _dense_model()
    prompt = mx.array([list(range(3, 40))])
    plain = model(prompt, model.make_cache())
    sizes = [dense_bytes(q) for q in _dense_layers(model)]
    keep_within(model, sum(sizes) // 2)
    assert mx.array_equal(model(prompt, model.make_cache()), plain).item()


def test_auto_makes_no_copy_at_install():
    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    config = replace(KernelConfig.from_env(FAST, {"ENGINE_KEEP_DENSE": "auto"}), force=True)
    install(model, config)
    assert not any(getattr(m, "kept", None) is not None for _, m in model.named_modules())
