"""What `engine serve` resolves from its defaults: the batch cap, the decode buckets, the warm-up."""

import pytest

from engine.gateway import Gateway, GatewayConfig
from engine.kernels import EXACT, FAST, on_cuda
from engine.loading import load_model
from engine.server.main import ServeConfig, _warm_up, default_batch, default_warmup, power_buckets


def test_defaults_fit_the_device():
    assert default_batch() == (64 if on_cuda() else 8)
    assert default_warmup() == ("full" if on_cuda() else "quick")
    assert ServeConfig().gateway_config().batch == default_batch()


def test_decode_buckets_auto_pads_the_fast_tier_only():
    assert power_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and power_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    cfg = ServeConfig(batch=16)
    assert cfg.gateway_config(FAST).decode_buckets == (1, 2, 4, 8, 16)
    assert cfg.gateway_config(EXACT).decode_buckets == ()  # bit-exact with mlx-lm at every row count
    assert ServeConfig(batch=16, kv_bits=8).gateway_config(FAST).decode_buckets == ()
    assert ServeConfig(batch=1).gateway_config(FAST).decode_buckets == ()
    assert ServeConfig(batch=16, decode_buckets=()).gateway_config(FAST).decode_buckets == ()
    assert ServeConfig(batch=16, decode_buckets=(4, 16)).gateway_config(EXACT).decode_buckets == (4, 16)
    with pytest.raises(ValueError, match="quantized KV"):
        ServeConfig(batch=16, kv_bits=8, decode_buckets=(4, 16)).gateway_config(FAST)


@pytest.mark.parametrize("mode, requests", [("off", 0), ("quick", 2), ("full", 2 + 8)])
def test_warmups(tiny_path, mode, requests):
    model = load_model(tiny_path("tiny-qwen35"))[0]
    gateway = Gateway(model, GatewayConfig(batch=8, decode_buckets=(1, 2, 4, 8)))
    assert _warm_up(gateway, mode) == requests
    decoded = {shape[1] for shape in gateway.shapes if shape[0] == "decode"}
    assert decoded == ({1, 2, 4, 8} if mode == "full" else {2} if mode == "quick" else set())
    gateway.mark_ready()
    assert gateway.new_shapes == 0
