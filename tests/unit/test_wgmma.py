"""The warpgroup-MMA products (engine.kernels.quantized_gemv.wgmma): up to 64 rows times 4-bit matrices on Hopper,
against the staged kernel's rounded function (weights rounded once to bf16, float32 sums), alone and as the staged
launch's split parts (`StagedConfig.wgmma`, layout key WG)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.kernels.quantized_gemv import quantized_matmuls
from engine.kernels.quantized_gemv.layouts import StagedLayouts
from engine.kernels.quantized_gemv.staged import StagedConfig, splits, staged_config
from engine.kernels.quantized_gemv.wgmma import KC, takes, wgmma_parts
from harness.kernels.bench import random_quantized, rounded_reference, rounding_bound

cuda_only = pytest.mark.cuda  # built only on MLX's CUDA backend (sm_90a): skipped elsewhere (conftest)


def within_rounding(out: mx.array, want: mx.array) -> bool:
    """The staged kernel's bound on the rounded function: the bf16 output's rounding, far more than float32 sums
    in another order add."""
    return mx.all(mx.abs(out.astype(mx.float32) - want) <= rounding_bound(want)).item()


@cuda_only
@pytest.mark.parametrize("m", [1, 17, 33, 63, 64])
@pytest.mark.parametrize("n, k", [(1000, 1536), (4096, 17408), (34816, 5120)])
def test_wgmma_products_sum_the_rounded_function(m, n, k):
    # Each split's float32 sums, added. Rows past N copy row N - 1 and rows past M are not copied: neither
    # reaches a stored sum.
    mx.random.seed(m)
    w, scales, biases = random_quantized(n, k, 4, 64)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    out = wgmma_parts(x, [(w, scales, biases)], splits(k, KC)).sum(axis=0)
    assert within_rounding(out, rounded_reference(x, w, scales, biases, 64, 4))


@cuda_only
@pytest.mark.parametrize("m", [9, 40, 64])
def test_wgmma_parts_take_matrices_one_after_another(m):
    # Several matrices in one launch (a DeltaNet layer's inputs: rows not a whole number of blocks): each one's
    # rows where the staged kernel's parts keep them, its sums those of the matrix alone.
    mx.random.seed(m)
    matrices = [random_quantized(n, 5120, 4, 64) for n in (10240, 6144, 48, 48)]
    x = mx.random.normal((m, 1, 5120)).astype(mx.bfloat16)
    parts = wgmma_parts(x, matrices, 4)
    assert parts.shape == (4, m, 16480)
    at = 0
    for w, scales, biases in matrices:
        n = w.shape[0]
        alone = wgmma_parts(x, [(w, scales, biases)], 4)
        assert mx.array_equal(parts[:, :, at : at + n], alone).item()
        at += n


@cuda_only
@pytest.mark.parametrize("m", [9, 40, 64])
@pytest.mark.parametrize("stages", ["plain", "residual", "gated"])
def test_staged_launches_on_wgmma_run_their_fused_stages(m, stages):
    # WG=1: the staged launch's parts from the warpgroup MMA, then its own sums launch and fused stages; the results
    # those of the rounded launch (RW=1) to rounding.
    mx.random.seed(m)
    gate, up = random_quantized(3000, 5120, 4, 64), random_quantized(3000, 5120, 4, 64)
    x = mx.random.normal((m, 1, 5120)).astype(mx.bfloat16)
    residual = mx.random.normal((m, 1, 3000)).astype(mx.bfloat16)
    options = {"plain": {}, "residual": {"residual": residual}, "gated": {"gated": True}}[stages]
    matrices = [gate, up] if stages == "gated" else [gate]
    on = quantized_matmuls(x, matrices, 64, 4, StagedConfig(rounded=1, splits=4, wgmma=1), **options)[0]
    off = quantized_matmuls(x, matrices, 64, 4, StagedConfig(rounded=1, splits=4), **options)[0]
    assert on.shape == off.shape == (m, 1, 3000)
    f32 = mx.float32
    assert mx.all(mx.abs(on.astype(f32) - off.astype(f32)) <= 2.0**-7 * mx.abs(off.astype(f32)) + 1e-2).item()
    if stages == "plain":
        assert within_rounding(on.reshape(m, -1), rounded_reference(x.reshape(m, -1), *gate, 64, 4))


def test_wgmma_takes_up_to_64_rows_of_group_64_at_4_bits_in_whole_chunks():
    assert takes(64, 5120, 64, 4, 4) and takes(1, 17408, 64, 4, 8)
    assert not takes(65, 5120, 64, 4, 4)
    assert not takes(8, 5120, 32, 4, 4) and not takes(8, 5120, 64, 8, 4)
    assert not takes(8, 5120, 64, 4, 3) and not takes(8, 5120, 64, 4, 16)  # 1706.7 and 320 values a split
    w, scales, biases = random_quantized(256, 1024, 4, 64)
    with pytest.raises(ValueError, match="up to 64 rows"):
        wgmma_parts(mx.zeros((65, 1024), dtype=mx.bfloat16), [(w, scales, biases)], 1)
    with pytest.raises(ValueError, match="up to 64 rows"):
        wgmma_parts(mx.zeros((8, 1000), dtype=mx.bfloat16), [(w, scales, biases)], 1)


def test_the_wgmma_layout_key_turns_it_on_for_its_row_counts():
    layouts = StagedLayouts.parse("32,64:WG=1")
    assert [staged_config(m, 5120, 64, 4, layouts).wgmma for m in (16, 32, 64)] == [0, 1, 1]
    assert layouts.text() == "32,64:WG=1"
