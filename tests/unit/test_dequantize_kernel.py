"""The dense path's dequantization kernel (`engine.kernels.dequantize`): MLX's values bit for bit on CUDA, MLX's
operation elsewhere, and the switch that puts it in the fast tier's layers."""

import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.kernels import FAST, KernelConfig, install
from engine.kernels.dequantize import dequantize, dequantize_kernel, kernel_refusal
from engine.kernels.quantized_gemv import DENSE_MIN_ROWS, KernelQuantizedLinear

cuda_only = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout


def quantized(n, k, bits=4, group_size=64, dtype=mx.bfloat16, seed=0):
    mx.random.seed(seed)
    w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=bits)


def test_off_cuda_or_refused_it_is_mlx_s_dequantize():
    for bits, gs in ((4, 64), (8, 32), (3, 64)):
        w, s, b = quantized(48, 256, bits, gs)
        want = mx.dequantize(w, s, b, group_size=gs, bits=bits)
        assert mx.array_equal(dequantize(w, s, b, gs, bits), want).item()


def test_the_weights_it_refuses_say_why():
    w, s, _ = quantized(8, 256)
    assert kernel_refusal(w, s, 64, 4) is None
    assert "3-bit" in kernel_refusal(*quantized(8, 256, bits=3)[:2], 64, 3)
    assert "float32 scales" in kernel_refusal(w, s.astype(mx.float32), 64, 4)
    w8, s8, _ = quantized(8, 64, bits=8, group_size=32)
    assert kernel_refusal(w8, s8, 32, 8) is None  # 16-value runs: 64 inputs are whole runs


def test_the_switch_gives_the_dense_path_the_kernel():
    q = nn.QuantizedLinear.from_linear(nn.Linear(128, 256, bias=False), group_size=64, bits=4)
    on = KernelQuantizedLinear.from_module(q, True, dequant_kernel=True)
    off = KernelQuantizedLinear.from_module(q, True)
    assert on.dequantize is dequantize and off.dequantize is not dequantize
    x = mx.random.normal((1, DENSE_MIN_ROWS, 128)).astype(mx.bfloat16)
    assert mx.array_equal(on(x), off(x)).item()  # off CUDA both are MLX's values
    assert KernelConfig.from_env(FAST, {"ENGINE_DEQUANT_KERNEL": "1"}).settings()["dequant_kernel"] is True
    with pytest.raises(ValueError, match="ENGINE_DEQUANT_KERNEL"):
        KernelConfig.from_env(FAST, {"ENGINE_DEQUANT_KERNEL": "yes"})

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = q

    model = Holder()
    install(model, KernelConfig(FAST, force=True, dequant_kernel=True))
    assert model.proj.dequantize is dequantize


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit's compiler)")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 64)])
def test_every_build_compiles_without_spills(monkeypatch, dtype, bits, group_size):
    # the launch `dequantize_kernel` makes, built as MLX builds it and compiled by nvcc (tools.kernel_resources,
    # run from the checkout): no GPU needed
    from engine.kernels import dequantize as module
    from engine.kernels.cuda_source import compact
    from engine.kernels.kernel_cache import KernelBuild

    monkeypatch.syspath_prepend(str(ROOT))
    from tools.kernel_resources import compile_report

    builds = []

    def recording(*, name, input_names, output_names, source, header):
        def call(*, inputs, template, output_shapes, output_dtypes, grid, threadgroup):
            assert grid[0] % threadgroup[0] == 0 and grid[0] * module.UNITS * 128 >= inputs[0].size * 32
            types = tuple((x.dtype, x.ndim) for x in inputs)
            builds.append(
                KernelBuild(
                    name,
                    tuple(input_names),
                    tuple(output_names),
                    compact(source),
                    compact(header),
                    types,
                    tuple(output_dtypes),
                    tuple(template),
                )
            )
            return [mx.zeros(shape, dtype=dt) for shape, dt in zip(output_shapes, output_dtypes)]

        return call

    monkeypatch.setattr(module, "cuda_kernel", recording)
    module._kernel.cache_clear()
    try:
        w, s, b = quantized(3, 384, bits, group_size, dtype)
        assert dequantize_kernel(w, s, b, group_size, bits).shape == (3, 384)
    finally:
        module._kernel.cache_clear()
    report = compile_report(builds[0], "sm_90")
    assert "error" not in report, report.get("error")
    assert report["spill_stores"] == report["spill_loads"] == 0


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("n,k", [(1, 128), (3, 384), (257, 640), (1024, 5120)])
def test_the_kernel_gives_mlx_s_values_bit_for_bit(dtype, bits, group_size, n, k):
    # ragged run counts (n x k not a multiple of a block's runs) and a qwen27b-sized row length
    w, s, b = quantized(n, k, bits, group_size, dtype, seed=n + k)
    assert kernel_refusal(w, s, group_size, bits) is None
    got = dequantize_kernel(w, s, b, group_size, bits)
    want = mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert mx.array_equal(got, want).item(), mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
