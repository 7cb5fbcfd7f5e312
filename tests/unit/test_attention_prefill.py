"""Prompt chunks' causal attention as one CUDA launch (engine/kernels/attention_prefill.py): which calls it takes,
the masks it computes (a batch cache's own among them), how the fast tier installs it, and on CUDA its outputs
against a float32 reference beside MLX's own bf16 path."""

import math

import mlx.core as mx
import pytest

from engine.cache.batch_kv import BatchKVCache
from engine.cache.kv import KVCache
from engine.kernels import KernelConfig, install, on_cuda
from engine.kernels.attention_prefill import MIN_QUERIES, attention, kernel_mask, prefill_attention, runs, shared_bytes
from engine.loading import load_model
from engine.models.base import scaled_dot_product_attention

cuda_only = pytest.mark.cuda  # the kernel is built only on MLX's CUDA backend: skipped elsewhere (conftest)


def heads(b, hq, hkv, length, keys, d, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    q = (1.5 * mx.random.normal((b, hq, length, d))).astype(dtype)
    k = mx.random.normal((b, hkv, keys, d)).astype(dtype)
    v = mx.random.normal((b, hkv, keys, d)).astype(dtype)
    return q, k, v


def rule_mask(length: int, keys: int, causal: bool, pads) -> mx.array:
    """The kernel's rule as a boolean mask [B, 1, L, S]: query i at position S - L + i sees keys up to it (causal)
    and none below its row's pad."""
    cols = mx.arange(keys)[None, None, None]
    allowed = cols >= mx.array(pads)[:, None, None, None]
    if causal:
        allowed = allowed & (cols <= mx.arange(keys - length, keys)[None, None, :, None])
    return allowed


def reference(q, k, v, scale, causal, pads=None):
    """Attention in float32 on the CPU: GQA by repeating the key heads; a row with no key gives zeros."""
    with mx.stream(mx.cpu):
        q, k, v = (x.astype(mx.float32) for x in (q, k, v))
        reps = q.shape[1] // k.shape[1]
        k, v = mx.repeat(k, reps, 1), mx.repeat(v, reps, 1)
        allowed = rule_mask(q.shape[2], k.shape[2], causal, pads or [0] * q.shape[0])
        scores = mx.where(allowed, (q @ k.swapaxes(-1, -2)) * scale, -math.inf)
        weights = mx.where(allowed.any(-1, keepdims=True), mx.softmax(scores, axis=-1), 0.0)
        return weights @ v


def test_the_kernel_runs_bfloat16_heads_of_its_head_dims():
    q, k, v = heads(1, 4, 2, 80, 200, 256)
    assert runs(q, k, v) and runs(q[:, :, :2], k, v)
    assert not runs(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16))
    assert not runs(*heads(1, 4, 2, 80, 200, 96))  # head dims 64, 128 and 256 only
    assert not runs(*heads(1, 3, 2, 80, 200, 64))  # query heads a multiple of key heads
    assert not runs(q, k[:, :, :4], v[:, :, :4])  # fewer keys than queries
    assert not runs(q, k, v[:, :, :100])
    with pytest.raises(ValueError, match="no prefill attention kernel"):
        prefill_attention(q.astype(mx.float16), k, v, 0.1)


def test_the_masks_it_computes():
    assert kernel_mask(None, None) == (False, None)
    assert kernel_mask("causal", KVCache()) == (True, None)
    assert kernel_mask(mx.ones((4, 4), dtype=mx.bool_), KVCache()) is None  # an array it cannot read: MLX's path
    cache = BatchKVCache([0, 3])
    assert kernel_mask(cache.make_mask(4), cache) == (True, [0, 3])


@pytest.mark.parametrize("prefix_lengths, n", [([5, 0, 17], 9), ([0, 0], 6), ([40, 33], 1)])
def test_a_batch_cache_s_mask_is_the_kernel_s_rule(prefix_lengths, n):
    """BatchKVCache.make_mask over rows merged from prefixes of different lengths (right-aligned, left-padded)
    equals causal attention from each row's left padding on, which the kernel computes from the same cache."""
    singles = []
    for length in prefix_lengths:
        single = KVCache()
        if length:
            single.update_and_fetch(mx.zeros((1, 2, length, 8)), mx.zeros((1, 2, length, 8)))
        singles.append(single)
    cache = BatchKVCache.merge(singles)
    mask = cache.make_mask(n)
    keys, _ = cache.update_and_fetch(mx.zeros((len(singles), 2, n, 8)), mx.zeros((len(singles), 2, n, 8)))
    causal, pads = kernel_mask(mask, cache)
    assert causal and pads == [max(prefix_lengths) - length for length in prefix_lengths]
    assert mx.array_equal(
        mx.broadcast_to(mask, (len(singles), 1, n, keys.shape[2])), rule_mask(n, keys.shape[2], causal, pads)
    )


def test_its_tiles_fit_two_blocks_an_sm():
    assert 2 * shared_bytes(256) <= 227 << 10


def test_off_cuda_and_for_short_chunks_it_is_mlx_s_attention():
    q, k, v = heads(1, 4, 2, 80, 200, 64, dtype=mx.float32)
    assert mx.array_equal(
        attention(q, k, v, None, 0.125, "causal"), scaled_dot_product_attention(q, k, v, None, 0.125, "causal")
    )
    q, k, v = heads(1, 4, 2, MIN_QUERIES - 1, 200, 64)  # a verify window: MLX's products
    assert mx.array_equal(
        attention(q, k, v, None, 0.125, "causal"), scaled_dot_product_attention(q, k, v, None, 0.125, "causal")
    )


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
    "b, hq, hkv, length, keys, d, causal, pads",
    [
        (1, 24, 4, 300, 300, 256, True, None),  # qwen27b's heads, a first chunk (a partial last query block)
        (2, 8, 4, 70, 333, 256, True, None),  # a later chunk: queries at 263..332, keys in a partial last tile
        (3, 8, 4, 100, 260, 256, True, [0, 70, 130]),  # a batch cache's rows: left padding skips and cuts tiles
        (2, 4, 2, 65, 65, 128, True, [64, 3]),  # a row whose first 64 queries see no key: zeros
        (1, 6, 1, 128, 128, 128, True, None),
        (1, 4, 4, 64, 64, 64, True, None),
        (1, 4, 2, 100, 150, 64, False, None),
        (1, 2, 1, 2, 2, 256, True, None),  # two queries
    ],
)
def test_it_agrees_with_float32_attention_as_closely_as_mlx_s_bf16_path(b, hq, hkv, length, keys, d, causal, pads):
    q, k, v = heads(b, hq, hkv, length, keys, d, seed=length + keys)
    scale = d**-0.5
    want = reference(q, k, v, scale, causal, pads)
    ours = prefill_attention(q, k, v, scale, causal, pads).astype(mx.float32)
    mask = rule_mask(length, keys, causal, pads or [0] * b)
    mlx_path = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask).astype(mx.float32)
    seen = mx.broadcast_to(mask.any(-1, keepdims=True), want.shape)  # MLX's path: rows with no key are undefined
    err = mx.where(seen, mx.abs(ours - want), 0.0)
    mlx_err = mx.where(seen, mx.abs(mlx_path - want), 0.0)
    assert err.max().item() <= max(1.25 * mlx_err.max().item(), 1e-2)
    assert err.mean().item() <= 1.25 * mlx_err.mean().item()
    assert mx.all(mx.where(seen, True, ours == 0)).item()  # and the kernel's are zeros


@cuda_only
def test_a_new_prompt_length_builds_nothing_new():
    from engine.kernels.cuda_source import BUILDS

    q, k, v = heads(1, 4, 2, 100, 100, 256)
    mx.eval(prefill_attention(q, k, v, 0.0625))
    before = BUILDS.count()
    q, k, v = heads(2, 4, 2, 37, 900, 256)
    mx.eval(prefill_attention(q, k, v, 0.0625, True, [0, 400]))
    assert BUILDS.count() == before
