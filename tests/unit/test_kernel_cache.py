"""The kernel cache: MLX's module names for the engine's kernel builds, files MLX can load, and (on CUDA) that MLX
loads them and computes the same results."""

import os
import tempfile
import threading
import time

import mlx.core as mx
import pytest

from engine.kernels import kernel_cache
from engine.kernels.cuda_source import BUILDS, cuda_kernel
from engine.kernels.kernel_cache import KernelBuild, KernelCache, module_path, std_hash

BUILD = KernelBuild(
    name="engine_test_scale",
    input_names=("x", "w"),
    output_names=("y",),
    source="uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;\nif (i < N) y[i] = __float2bfloat16(__bfloat162float(x[i]) * w[0] * S);",
    header="#include <cuda_bf16.h>\n",
    inputs=((mx.bfloat16, 1), (mx.float32, 1)),
    output_dtypes=(mx.bfloat16,),
    template=(("N", 1000), ("S", 3), ("F", True)),
)


def test_std_hash_is_libstdcxx_string_hash():
    # std::hash<std::string> on x86-64 Linux (g++ 12), printed with %zx
    assert format(std_hash(b"hello world, this is a test string!"), "x") == "f2a235982ab8251c"
    assert format(std_hash(b""), "x") == "553e93901e462a6e"
    assert format(std_hash(b"abc"), "x") == "32d82bf8ed3dba39"


def test_the_source_and_name_are_mlx_build_kernels():
    # MLX 0.32's custom_kernel.cpp: default header, the kernel's header, the signature, template constants, body
    assert BUILD.kernel_name == "custom_kernel_engine_test_scale_1000_3_t"
    assert BUILD.mlx_source() == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "#include <cuda_bf16.h>\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_engine_test_scale_1000_3_t(\n"
        "    const __nv_bfloat16* x,\n    const float* w,\n    __nv_bfloat16* y) {\n"
        "  constexpr int N = 1000;\n  constexpr int S = 3;\n  constexpr bool F = true;\n\n"
        + BUILD.source
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )
    assert BUILD.module_name() == f"{BUILD.kernel_name}_{std_hash(BUILD.mlx_source().encode()):x}"
    assert not BUILD.reads_shapes()


def test_long_module_names_nest_as_mlx_does(tmp_path):
    assert module_path(tmp_path, "a" * 245) == tmp_path / ("a" * 245 + ".ptx")
    assert module_path(tmp_path, "a" * 245 + "bc") == tmp_path / ("a" * 245) / "bc.ptx"


def test_builds_compile_in_parallel_into_files_mlx_reads(tmp_path):
    started, release = [], threading.Event()

    def compiler(source, kernel):
        started.append(kernel)
        release.wait(5)
        return b"CUBIN" + source.encode()[:8], "_Z6mangled"

    cache = KernelCache(tmp_path, compiler, workers=4)
    builds = [KernelBuild(**{**BUILD.__dict__, "template": (("N", n), ("S", 3), ("F", True))}) for n in (1, 2, 3)]
    for b in builds:
        cache.submit(b)
    cache.submit(builds[0])  # asked again: nothing more
    deadline = time.time() + 5
    while len(started) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(started) == 3  # all three at once
    release.set()
    cache.settle()
    assert cache.stats() | {"directory": None} == {"directory": None, "compiled": 3, "found": 0, "failed": 0}
    for b in builds:
        path = module_path(tmp_path, b.module_name())
        assert path.read_bytes().startswith(b"CUBIN")
        assert path.with_suffix(".txt").read_text() == f"mlx::core::cu::{b.kernel_name}\t_Z6mangled\n"
    again = KernelCache(tmp_path, compiler)  # a restart: every build is there
    for b in builds:
        again.submit(b)
    again.settle()
    assert (again.compiled, again.found) == (0, 3)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_build_that_does_not_compile_is_left_to_mlx(tmp_path, caplog):
    def compiler(source, kernel):
        raise RuntimeError("NVRTC could not compile it")

    cache = KernelCache(tmp_path, compiler)
    cache.submit(BUILD)
    cache.settle()
    assert (cache.compiled, cache.failed) == (0, 1) and not list(tmp_path.iterdir())
    assert "MLX compiles custom_kernel_engine_test_scale" in caplog.text
    shapes = KernelBuild(**{**BUILD.__dict__, "source": "y[0] = x_shape[0];"})
    cache.submit(shapes)  # MLX would add shape parameters this does not build: not compiled here
    cache.settle()
    assert (cache.compiled, cache.failed) == (0, 1)


def test_a_kernel_call_hands_its_new_build_to_the_active_cache(tmp_path, monkeypatch):
    got, ran = [], []
    cache = KernelCache(tmp_path, lambda source, kernel: got.append(kernel) or (b"x", "m"))
    monkeypatch.setattr(BUILDS, "cache", cache)
    monkeypatch.setattr(
        mx.fast, "cuda_kernel", lambda **kw: lambda **call: ran.append(call["template"])
    )  # no CUDA here
    kernel = cuda_kernel(name="engine_test_submit", input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    x = mx.zeros((4,), mx.float32)
    for n in (4, 4, 8):
        kernel(
            inputs=[x],
            template=[("N", n)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
    cache.settle()
    # each new build once (the pool compiles them in parallel, so they finish in either order)
    assert sorted(got) == [
        "mlx::core::cu::custom_kernel_engine_test_submit_4",
        "mlx::core::cu::custom_kernel_engine_test_submit_8",
    ]
    assert ran == [[("N", 4)], [("N", 4)], [("N", 8)]]


def _mlx_printed_source(call) -> str:
    """What MLX prints of a kernel's source with verbose=True (its std::cout, fd 1)."""
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            call()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]


@pytest.mark.cuda
def test_mlx_loads_the_cached_build_and_computes_the_same(tmp_path):
    # MLX's own text of a build is ours; a module written under a build's name is the one MLX runs (here one
    # that scales twice as much); and a build compiled through the cache gives what MLX's own compile gives
    directory = os.environ.get("MLX_PTX_CACHE_DIR")
    if not directory:
        pytest.skip("MLX_PTX_CACHE_DIR names MLX's cache directory only when set before MLX's first compilation")
    kernel = mx.fast.cuda_kernel(
        name=BUILD.name,
        input_names=list(BUILD.input_names),
        output_names=["y"],
        source=BUILD.source,
        header=BUILD.header,
    )
    x, w = mx.random.normal((1000,)).astype(mx.bfloat16), mx.array([0.5])

    def run(build, verbose=False):
        return kernel(
            inputs=[x, w],
            template=list(build.template),
            grid=(1024, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(1000,)],
            output_dtypes=[mx.bfloat16],
            verbose=verbose,
        )[0]

    def scaled(s):
        return (x.astype(mx.float32) * 0.5 * s).astype(mx.bfloat16)

    tag = int(time.time() * 1000) % 1_000_000  # builds no earlier run left in the directory
    build = lambda n, s: KernelBuild(**{**BUILD.__dict__, "template": (("N", 1000), ("S", s), ("F", True), ("T", n))})  # noqa: E731
    printed = _mlx_printed_source(lambda: mx.eval(run(build(tag, 3), verbose=True)))
    assert printed == build(tag, 3).mlx_source()

    decoy = build(tag + 1, 5)
    twice = KernelBuild(**{**decoy.__dict__, "source": BUILD.source.replace("* S)", "* S * 2)")})
    code, mangled = kernel_cache.nvrtc_compiler()(twice.mlx_source(), f"mlx::core::cu::{decoy.kernel_name}")
    path = module_path(type(tmp_path)(directory), decoy.module_name())
    path.with_suffix(".txt").write_text(f"mlx::core::cu::{decoy.kernel_name}\t{mangled}\n")
    path.write_bytes(code)
    assert mx.array_equal(run(decoy), scaled(10)).item()  # the decoy's module, not MLX's compile of the build

    cache = KernelCache(type(tmp_path)(directory))
    real = build(tag + 2, 7)
    cache.submit(real)
    cache.settle()
    assert cache.stats()["compiled"] == 1, cache.stats()
    assert mx.array_equal(run(real), scaled(7)).item()
