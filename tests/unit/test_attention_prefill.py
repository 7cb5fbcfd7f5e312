"""Prompt chunks' causal attention as one CUDA launch (engine/kernels/attention_prefill.py): which calls it takes,
how the fast tier installs it, and on CUDA its outputs against a float32 reference beside MLX's own bf16 path."""

import math

import mlx.core as mx
import pytest

from engine.kernels import KernelConfig, install, on_cuda
from engine.kernels.attention_prefill import (
    MIN_QUERIES,
    applies,
    attention,
    prefill_attention,
    runs,
    shared_bytes,
)
from engine.loading import load_model
from engine.models.base import scaled_dot_product_attention

cuda_only = pytest.mark.cuda  # the kernel is built only on MLX's CUDA backend: skipped elsewhere (conftest)


def heads(b, hq, hkv, length, keys, d, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    q = (1.5 * mx.random.normal((b, hq, length, d))).astype(dtype)
    k = mx.random.normal((b, hkv, keys, d)).astype(dtype)
    v = mx.random.normal((b, hkv, keys, d)).astype(dtype)
    return q, k, v


def reference(q, k, v, scale, causal):
    """Attention in float32 on the CPU: GQA by repeating the key heads, query i of L at position S - L + i."""
    with mx.stream(mx.cpu):
        q, k, v = (x.astype(mx.float32) for x in (q, k, v))
        reps = q.shape[1] // k.shape[1]
        k, v = mx.repeat(k, reps, 1), mx.repeat(v, reps, 1)
        scores = (q @ k.swapaxes(-1, -2)) * scale
        if causal:
            length, keys = q.shape[2], k.shape[2]
            allowed = mx.arange(keys)[None] <= mx.arange(keys - length, keys)[:, None]
            scores = mx.where(allowed, scores, -math.inf)
        return mx.softmax(scores, axis=-1) @ v


def test_it_takes_bfloat16_prompt_chunks_with_a_causal_mask_or_none():
    q, k, _ = heads(1, 4, 2, 80, 200, 256)
    assert applies(q, k, "causal") and applies(q, k, None)
    assert not applies(q, k, mx.ones((80, 200), dtype=mx.bool_))  # an array mask (left padding): MLX's path
    assert not applies(q[:, :, : MIN_QUERIES - 1], k, "causal") and runs(q[:, :, :2], k, "causal")  # a verify window
    assert not runs(q.astype(mx.float16), k.astype(mx.float16), "causal")
    assert not runs(*heads(1, 4, 2, 80, 200, 96)[:2], "causal")  # head dims 64, 128 and 256 only
    assert not runs(*heads(1, 3, 2, 80, 200, 64)[:2], "causal")  # query heads a multiple of key heads
    assert not runs(q, k[:, :, :4], "causal")  # fewer keys than queries
    with pytest.raises(ValueError, match="no prefill attention kernel"):
        prefill_attention(q.astype(mx.float16), k, k, 0.1, "causal")


def test_its_tiles_fit_two_blocks_an_sm():
    assert 2 * shared_bytes(256) <= 227 << 10


def test_off_cuda_it_is_mlx_s_attention():
    q, k, v = heads(1, 4, 2, 80, 200, 64, dtype=mx.float32)
    ours = attention(q, k, v, None, 0.125, "causal")
    theirs = scaled_dot_product_attention(q, k, v, None, 0.125, "causal")
    assert mx.array_equal(ours, theirs)


def test_a_setting_off_by_default_read_from_the_environment():
    assert not KernelConfig().prefill_attention_kernel
    assert KernelConfig.from_env("fast", {"ENGINE_PREFILL_ATTENTION_KERNEL": "1"}).prefill_attention_kernel
    assert KernelConfig(prefill_attention_kernel=True).settings()["prefill_attention_kernel"] is True
    with pytest.raises(ValueError):
        KernelConfig.from_env("fast", {"ENGINE_PREFILL_ATTENTION_KERNEL": "yes"})


def test_the_fast_tier_installs_it_only_on_cuda(tiny_path):
    model = load_model(tiny_path("tiny-qwen35-4bit"))[0]
    kernels = install(model, KernelConfig(tier="fast", force=True, prefill_attention_kernel=True))
    layers = [m for _, m in model.named_modules() if hasattr(m, "prefill_attention")]
    assert layers
    assert kernels.prefill_attention_layers == (len(layers) if on_cuda() else 0)
    assert all((m.prefill_attention is not None) == on_cuda() for m in layers)
    install(model, KernelConfig(tier="exact"))
    assert all(m.prefill_attention is None for m in layers)


@cuda_only
@pytest.mark.parametrize(
    "b, hq, hkv, length, keys, d, causal",
    [
        (1, 24, 4, 300, 300, 256, True),  # qwen27b's heads, a first chunk (a partial last query block)
        (2, 8, 4, 70, 333, 256, True),  # a later chunk: queries at 263..332, keys in a partial last tile
        (1, 6, 1, 128, 128, 128, True),
        (1, 4, 4, 64, 64, 64, True),
        (1, 4, 2, 100, 150, 64, False),
        (1, 2, 1, 2, 2, 256, True),  # two queries
    ],
)
def test_it_agrees_with_float32_attention_as_closely_as_mlx_s_bf16_path(b, hq, hkv, length, keys, d, causal):
    q, k, v = heads(b, hq, hkv, length, keys, d, seed=length + keys)
    scale = d**-0.5
    mask = "causal" if causal else None
    want = reference(q, k, v, scale, causal)
    ours = prefill_attention(q, k, v, scale, mask).astype(mx.float32)
    mlx_path = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32)
    err = mx.abs(ours - want)
    mlx_err = mx.abs(mlx_path - want)
    assert err.max().item() <= max(1.25 * mlx_err.max().item(), 1e-2)
    assert err.mean().item() <= 1.25 * mlx_err.mean().item()


@cuda_only
def test_a_new_prompt_length_builds_nothing_new():
    from engine.kernels.cuda_source import BUILDS

    q, k, v = heads(1, 4, 2, 100, 100, 256)
    mx.eval(prefill_attention(q, k, v, 0.0625, "causal"))
    before = BUILDS.count()
    q, k, v = heads(1, 4, 2, 37, 900, 256)
    mx.eval(prefill_attention(q, k, v, 0.0625, "causal"))
    assert BUILDS.count() == before
