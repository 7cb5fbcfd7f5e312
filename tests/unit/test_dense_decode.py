"""Launches on kept dense copies from many rows (`quantized_gemv.dense`, ENGINE_DENSE_DECODE_ROWS)."""

import mlx.core as mx
import pytest

from engine.engine import Engine
from engine.kernels import FAST, KernelConfig, install
from engine.kernels.quantized_gemv.dense import stages


def _products_launch(calls):
    # run_kernel's results from MLX's quantized product and the stages as MLX operations, on any backend
    def launch(x, layers, residual=None, gated=False, norm_out=None, prenormed=None, **_):
        calls.append(x.size // x.shape[-1])
        ys = [
            mx.quantized_matmul(
                x, q["weight"], q["scales"], q["biases"], transpose=True, group_size=q.group_size, bits=q.bits
            )
            for q in layers
        ]
        return stages(x, ys, residual, gated, norm_out, prenormed)

    return launch


def _decode(dense_rows: int, rows: int = 2):
    """tiny-qwen35-4bit's fast tier decoding `rows` rows 4 steps (every layer's copy kept, prompts never on the dense
    path): each step's logits, and the rows of each launch that did not run on the copies."""
    model = Engine.load("tiny-qwen35-4bit", with_tokenizer=False).model
    calls = []
    config = KernelConfig(
        FAST,
        force=True,
        gemv_min_outputs=0,
        gemv_stand_in=_products_launch(calls),
        keep_dense=True,
        dense_min_rows=1000,
        dense_decode_rows=dense_rows,
    )
    install(model, config)
    cache = model.make_cache()
    model(mx.array([list(range(3 + 10 * r, 11 + 10 * r)) for r in range(rows)]), cache)
    calls.clear()
    logits = [model(mx.array([[20 + t + r] for r in range(rows)]), cache)[:, -1] for t in range(4)]
    mx.eval(logits)
    return logits, calls


def test_from_its_rows_every_launch_of_a_decode_step_runs_on_the_copies():
    plain, launched = _decode(0)
    assert launched and set(launched) == {2}
    dense, launched = _decode(2)
    assert launched == []
    for a, b in zip(plain, dense):  # the same weights, rounded to bf16 once instead of inside the product
        scale = mx.abs(a.astype(mx.float32)).max()
        assert mx.all(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)) <= 2.0**-5 * scale).item()


def test_fewer_rows_run_the_launch():
    _, launched = _decode(3)
    assert launched and set(launched) == {2}


def test_the_setting_is_read_from_the_environment():
    for keep in ("1", "auto"):
        env = {"ENGINE_DENSE_DECODE_ROWS": "48", "ENGINE_KEEP_DENSE": keep}
        assert KernelConfig.from_env(FAST, env).dense_decode_rows == 48
    assert KernelConfig.from_env(FAST, {}).settings()["dense_decode_rows"] == 0
    with pytest.raises(ValueError, match="ENGINE_DENSE_DECODE_ROWS must be a whole number"):
        KernelConfig.from_env(FAST, {"ENGINE_DENSE_DECODE_ROWS": "many", "ENGINE_KEEP_DENSE": "1"})
    with pytest.raises(ValueError, match="need kept dense copies"):  # nothing to multiply: said, not ignored
        KernelConfig.from_env(FAST, {"ENGINE_DENSE_DECODE_ROWS": "48"})


def test_the_flags_set_the_copies_and_rows_over_the_environment(monkeypatch):
    from engine.cli import build_parser, kernel_config

    def config(*flags):
        return kernel_config(build_parser().parse_args(["serve", "--model", "m", *flags]))

    monkeypatch.setenv("ENGINE_KEEP_DENSE", "1")
    monkeypatch.setenv("ENGINE_DENSE_DECODE_ROWS", "32")
    assert (config().keep_dense, config().dense_decode_rows) == (True, 32)
    auto = config("--dense-copies", "auto", "--dense-decode-rows", "48")
    assert (auto.keep_dense, auto.keep_dense_auto, auto.dense_decode_rows) == (False, True, 48)
    off = config("--dense-copies", "off", "--dense-decode-rows", "0")
    assert (off.keep_dense, off.keep_dense_auto, off.dense_decode_rows) == (False, False, 0)
    with pytest.raises(ValueError, match="need kept dense copies"):
        config("--dense-copies", "off")
    with pytest.raises(ValueError, match="0 \\(never\\) or more"):
        config("--dense-decode-rows", "-1")


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [48, 64])
def test_a_dense_launch_gives_the_kernel_launch_s_results(rows):
    # gate+up (gated, prenormed) and a down projection (residual, norm_out) on random 4-bit layers: the kernel's
    # launch against the same launch on the dense copies, to the rounding of the bf16 products (2^-6 of the values)
    import mlx.nn as nn

    from engine.kernels.quantized_gemv import run_kernel
    from engine.kernels.quantized_gemv.dense import dense_launch
    from engine.kernels.quantized_gemv.layer import KernelQuantizedLinear

    def layer(n, k):
        q = nn.QuantizedLinear(k, n, bias=False, group_size=64, bits=4)
        q.scales, q.biases = q.scales.astype(mx.bfloat16), q.biases.astype(mx.bfloat16)
        return KernelQuantizedLinear.from_module(q, True, keep_dense=True)

    def close(a, b):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        return mx.all(mx.abs(a - b) <= 2.0**-6 * mx.abs(a).max()).item()

    mx.random.seed(3)
    gate, up, down = layer(2048, 1024), layer(2048, 1024), layer(1024, 2048)
    x = mx.random.normal((rows, 1, 1024)).astype(mx.bfloat16)
    parts = mx.abs(mx.random.normal((rows, 7))) * 100
    a = run_kernel(x, [gate, up], gated=True, prenormed=(parts, 1e-6))[0]
    b = dense_launch(x, [gate, up], gated=True, prenormed=(parts, 1e-6))[0]
    assert close(a, b)
    act, residual, norm_w = a, mx.random.normal((rows, 1, 1024)).astype(mx.bfloat16), mx.ones(1024, mx.bfloat16)
    h, hw, ssq = run_kernel(act, [down], residual=residual, norm_out=norm_w)
    dh, dhw, dssq = dense_launch(act, [down], residual=residual, norm_out=norm_w)
    assert close(h, dh) and close(hw, dhw) and close(ssq.sum(axis=-1), dssq.sum(axis=-1))


def test_a_window_takes_the_copies_by_its_batch_rows_not_its_tokens():
    from types import SimpleNamespace

    from engine.kernels.quantized_gemv.dense import takes

    layer = SimpleNamespace(kept=object())
    assert takes(mx.zeros((48, 1, 8)), [layer], 48) and takes(mx.zeros((64, 8)), [layer], 48)
    assert not takes(mx.zeros((8, 6, 8)), [layer], 48)  # a verify window: 48 launch rows, 8 batch rows
    assert not takes(mx.zeros((48, 1, 8)), [SimpleNamespace(kept=None)], 48)
    assert not takes(mx.zeros((48, 1, 8)), [layer], 0)  # 0: never
