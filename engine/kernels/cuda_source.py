"""The engine's CUDA kernels as MLX builds them: sources without comments or indentation.

MLX 0.32.4's CUDA backend hashes a custom kernel's whole built source (its
header, signature and body) at every evaluation of every call, to find the
compiled module (`CustomKernel::eval_gpu`), and the Python call concatenates
it again whenever it is not replayed from a compiled graph. The GEMV's is
~13 KB, of which comments and indentation are ~30%; a decode step evaluates
~375 kernel calls, and std::hash runs at ~6 GB/s on these hosts, so every
KB is ~0.06 ms a step. `compact` drops what the compiler ignores: comments
and the spaces around each line. Lines stay lines (preprocessor directives
end at a newline), string and character literals are left as they are, and
the code is the same token for token (`tests/unit/test_cuda_source.py` checks;
nvcc gives the same SASS).

MLX compiles a custom kernel once per process for each built source (its
template values and input and output types), with NVRTC, when a graph that
calls it is first evaluated, and keeps it in memory only: unlike its own
kernels, MLX 0.32's `CustomKernel` never writes them to MLX_PTX_CACHE_DIR, so a
new process compiles them again. `KernelBuilds` counts the distinct builds
the process has asked for (each one such compilation on CUDA), which the server
reports so that a compilation after ready can be seen, and hands each new one
to its kernel cache where one is on (`kernel_cache`: compiled ahead of MLX, in
parallel, and kept across restarts). The kernel set (`KernelSet.builds`) holds
it; as MLX's compilations are the process's, so is it (`BUILDS`).
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx

from engine.kernels.kernel_cache import KernelBuild, KernelCache


class KernelBuilds:
    """The distinct custom-kernel builds (name, template values, input and output types) a process has asked MLX
    for, on CUDA each one NVRTC compilation, and the kernel cache that compiles them ahead of MLX (None: off)."""

    def __init__(self) -> None:
        self.cache: KernelCache | None = None
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    def count(self) -> int:
        return len(self._seen)

    def __contains__(self, key: tuple) -> bool:
        return key in self._seen

    def enable_cache(self, directory: Path) -> KernelCache:
        """Compile the engine's kernels into `directory`, which must be MLX's cache directory (MLX_PTX_CACHE_DIR),
        from now on."""
        self.cache = KernelCache(directory)
        return self.cache

    def settle(self) -> None:
        """Wait for the kernels being compiled ahead of MLX, if any (call before evaluating a forward)."""
        if self.cache is not None:
            self.cache.settle()

    def add(self, key: tuple, build: KernelBuild | None) -> None:
        """Count the build `key` if new, and hand `build` (None: one the cache cannot compile) to the cache."""
        if key in self._seen:
            return
        with self._lock:
            new = key not in self._seen
            self._seen.add(key)
        if new and build is not None and self.cache is not None:
            self.cache.submit(build)


BUILDS = KernelBuilds()  # this process's: MLX compiles a custom kernel once a process

# Device functions that more than one kernel's header holds (a header is part of its own build's source, so each
# kernel carries its own copy of the text): a 16-byte cp.async copy into shared memory (cached in L2 only), the
# bf16 tensor-core product and float32 pairs as bf16.
CP_ASYNC16 = r"""
__device__ __forceinline__ void engine_cp16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}
"""
MMA_BF16 = r"""
__device__ __forceinline__ void engine_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
  // d (16x8 float32) += a (16x16 bf16, row-major) * b (16x8 bf16, column-major)
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""
TO_BF16X2 = r"""
__device__ __forceinline__ uint32_t engine_to_bf16x2(float a, float b) {
  __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&r);
}
"""


def _strip_comment(line: str) -> str:
    """`line` up to a `//` comment outside string and character literals."""
    quote, escaped = "", False
    for i, c in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif line.startswith("//", i):
            return line[:i]
    return line


def compact(source: str) -> str:
    """`source` without `//` comments, leading or trailing spaces, or blank lines."""
    lines = (_strip_comment(line).strip() for line in source.splitlines())
    return "".join(line + "\n" for line in lines if line)


def cuda_kernel(
    *,
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    header: str = "",
    shared_memory: int = 0,
    builds: KernelBuilds = BUILDS,
):
    """`mx.fast.cuda_kernel` on the compacted source and header (`shared_memory`: its dynamic bytes), counting
    its builds in `builds` (the process's)."""
    source, header = compact(source), compact(header)
    kernel = mx.fast.cuda_kernel(
        name=name,
        input_names=input_names,
        output_names=output_names,
        source=source,
        header=header,
        shared_memory=shared_memory,
    )

    def call(*, inputs, template=(), output_dtypes, **kwargs):
        key = (name, shared_memory, tuple(template), tuple((x.dtype, x.ndim) for x in inputs), tuple(output_dtypes))
        if key not in builds:  # every call asks: most builds are known
            build = None
            if all(isinstance(v, (int, bool)) for _, v in template):
                build = KernelBuild(
                    name,
                    tuple(input_names),
                    tuple(output_names),
                    source,
                    header,
                    key[3],
                    tuple(output_dtypes),
                    tuple(template),
                )
            builds.add(key, build)
        return kernel(inputs=inputs, template=list(template), output_dtypes=output_dtypes, **kwargs)

    return call
