"""The wgmma prototype (engine.kernels.quantized_gemv.wgmma): up to 64 rows times a 4-bit matrix on Hopper's
warpgroup MMA, against the staged kernel's rounded function (weights rounded once to bf16, float32 sums)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.kernels.quantized_gemv.wgmma import wgmma_parts
from harness.kernels.bench import random_quantized, rounded_reference

cuda_only = pytest.mark.cuda  # built only on MLX's CUDA backend (sm_90a): skipped elsewhere (conftest)


@cuda_only
@pytest.mark.parametrize("m", [1, 17, 33, 63, 64])
@pytest.mark.parametrize("n, k", [(1000, 1536), (4096, 17408), (34816, 5120)])
def test_wgmma_products_sum_the_rounded_function(m, n, k):
    # Each split's float32 sums, added: the rounded function to float32 summation order (the staged kernel's
    # bound, which allows the bf16 output's rounding: far more than float32 sums in another order add). Rows
    # past N copy row N - 1 and rows past M are not copied: neither reaches a stored sum.
    mx.random.seed(m)
    w, scales, biases = random_quantized(n, k, 4, 64)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    want = rounded_reference(x, w, scales, biases, 64, 4)
    out = wgmma_parts(x, w, scales, biases).sum(axis=0)
    tol = 2.0**-8 * mx.abs(want) + 1e-4 * mx.abs(want).max()
    assert mx.all(mx.abs(out - want) <= tol).item(), mx.abs(out - want).max().item()


def test_wgmma_takes_up_to_64_rows_of_group_64_at_4_bits():
    w, scales, biases = random_quantized(256, 1024, 4, 64)
    with pytest.raises(ValueError, match="up to 64 rows"):
        wgmma_parts(mx.zeros((65, 1024), dtype=mx.bfloat16), w, scales, biases)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        wgmma_parts(mx.zeros((8, 1000), dtype=mx.bfloat16), w, scales, biases)
