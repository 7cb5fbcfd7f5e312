"""The engine's CUDA kernels compiled ahead of MLX, in parallel, into MLX's module cache directory.

MLX 0.32 compiles a custom kernel (`mx.fast.cuda_kernel`) with NVRTC when a
graph that calls it is first evaluated, one module at a time (its module
table is locked while one compiles), and keeps it in memory only. Before it
compiles any module, though, it looks for `<module name>.ptx` (the compiled
code) and `.txt` (kernel names, mangled) in its cache directory
(MLX_PTX_CACHE_DIR) and loads those instead. A custom kernel's module name is
`custom_kernel_<name><template values>_<hash>`, the hash being libstdc++'s
std::hash of the source MLX builds around the kernel's body.

So when a kernel build is first asked for (at trace time, before the graph
runs), the engine builds that source as MLX does (`mlx_source`), compiles it
itself, one process a compilation on a pool of workers (`engine.nvrtc`: NVRTC
with the options MLX uses), and writes the cubin under that name; `settle()`,
called before a forward is evaluated, waits for the compilations in flight. A forward's new kernels thus
compile together, and a restart on the same directory compiles none. Where
anything here does not hold (another MLX, no NVRTC, a source that reads
shapes), no file is written and MLX compiles the kernel itself, as before.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from engine import nvrtc

log = logging.getLogger(__name__)

# MLX 0.32's custom_kernel.cpp: what it puts before and around a kernel's body.
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
COMPILE_TIMEOUT_S = 600  # a compilation past this is left to MLX
MAX_FILE_NAME = 245  # jit_module.cpp's get_ptx_path: longer module names become nested directories
CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
    mx.float64: "double",
}
_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s std::hash of a string on a 64-bit machine (`_Hash_bytes`, MurmurHash64A-like)."""

    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * _MUL)) & _MASK
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i : i + 8], "little")
        h ^= (shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = (shift_mix(h) * _MUL) & _MASK
    return shift_mix(h)


@dataclass(frozen=True)
class KernelBuild:
    """One build of a custom kernel, as `mx.fast.cuda_kernel` makes it."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    inputs: tuple[tuple[mx.Dtype, int], ...]  # each input's dtype and ndim
    output_dtypes: tuple[mx.Dtype, ...]
    template: tuple[tuple[str, int | bool], ...]

    @property
    def kernel_name(self) -> str:
        """MLX's `custom_kernel_<name><template hash>`."""
        suffix = "".join(("_t" if v else "_f") if isinstance(v, bool) else f"_{v}" for _, v in self.template)
        return f"custom_kernel_{self.name}{suffix}"

    def reads_shapes(self) -> bool:
        """Whether the body reads an input's shape, strides or ndim (MLX then adds parameters this does not
        build)."""
        return any(f"{n}_{what}" in self.source for n in self.input_names for what in ("shape", "strides", "ndim"))

    def mlx_source(self) -> str:
        """The source MLX compiles for this build (custom_kernel.cpp's build_kernel)."""
        params = [
            f"    const {CUDA_TYPES[dtype]}* {name},\n" for name, (dtype, _) in zip(self.input_names, self.inputs)
        ]
        outs = [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in zip(self.output_names, self.output_dtypes)]
        consts = "".join(
            f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = "
            f"{str(v).lower() if isinstance(v, bool) else v};\n"
            for k, v in self.template
        )
        return (
            DEFAULT_HEADER
            + self.header
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {self.kernel_name}(\n"
            + "".join(params)
            + ",\n".join(outs)
            + ") {\n"
            + (consts + "\n" if self.template else "")
            + self.source
            + "\n}\n\n} // namespace mlx::core::cu\n"
        )

    def module_name(self, source: str | None = None) -> str:
        """MLX's module name for this build (`source`: its `mlx_source()`, where already built)."""
        return f"{self.kernel_name}_{std_hash((source or self.mlx_source()).encode()):x}"


def module_path(directory: Path, module_name: str) -> Path:
    """Where MLX looks for a module's compiled code (jit_module.cpp's get_ptx_path)."""
    path, offset = directory, 0
    while len(module_name) - offset > MAX_FILE_NAME:
        path /= module_name[offset : offset + MAX_FILE_NAME]
        offset += MAX_FILE_NAME
    return path / (module_name[offset:] + ".ptx")


def _include_dirs() -> list[Path]:
    """MLX's NVRTC include paths (jit_module.cpp's include_path_args)."""
    root = Path(mx.__file__).resolve().parent  # site-packages/mlx (libmlx.so is in lib/ below it)
    dirs = [d for d in (root / "include", root / "include" / "cccl") if d.exists()]
    bundled = root.parent / "nvidia" / "cu13" / "include"
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(bundled if bundled.exists() else Path(home) / "include")
    return dirs


Compiler = Callable[[str, str], tuple[bytes, str]]  # (source, kernel name) -> (compiled code, mangled name)


def nvrtc_compiler() -> Compiler:
    """NVRTC as MLX runs it, for the device this process uses, each compilation in a process of its own
    (`engine.nvrtc`: one process compiles one program at a time)."""
    major, minor = nvrtc.device_arch()
    command = [sys.executable, "-m", "engine.nvrtc", "--arch", f"{major}.{minor}"]
    for d in _include_dirs():
        command += ["--include", str(d)]
    library = nvrtc.loaded_library()  # the one MLX loaded, wherever it was found
    if library:
        command += ["--library", library]

    def compile(source: str, kernel: str) -> tuple[bytes, str]:
        done = subprocess.run(
            [*command, "--kernel", kernel], input=source.encode(), capture_output=True, timeout=COMPILE_TIMEOUT_S
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.decode(errors="replace")[-2000:] or f"exit status {done.returncode}")
        mangled, code = done.stdout.split(b"\n", 1)
        return code, mangled.decode()

    return compile


@dataclass
class KernelCache:
    """Compiles kernel builds into `directory` (MLX's cache directory) on `workers` threads. `compiler`: made
    on first use (`nvrtc_compiler`) unless given."""

    directory: Path
    compiler: Compiler | None = None
    workers: int = field(default_factory=lambda: os.cpu_count() or 4)
    compiled: int = 0  # builds this process compiled
    found: int = 0  # builds already in the directory
    failed: int = 0  # builds left to MLX (an error here; the first is logged)
    _pending: list[Future] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kernel-cache")

    def submit(self, build: KernelBuild) -> None:
        """Start compiling `build` unless it is in the directory already (or MLX cannot use what this writes)."""
        if build.reads_shapes() or any(dtype not in CUDA_TYPES for dtype, _ in build.inputs):
            return
        source = build.mlx_source()
        name = build.module_name(source)
        with self._lock:
            if name in self._seen:
                return
            self._seen.add(name)
            if module_path(self.directory, name).exists():
                self.found += 1
                return
            self._pending.append(self._pool.submit(self._compile, build, source, name))

    def settle(self) -> None:
        """Wait for the compilations in flight (before MLX evaluates the graphs that use them)."""
        if not self._pending:  # every decode step asks: most find nothing in flight
            return
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def stats(self) -> dict:
        return {"directory": str(self.directory), "compiled": self.compiled, "found": self.found, "failed": self.failed}

    def _compile(self, build: KernelBuild, source: str, name: str) -> None:
        try:
            with self._lock:
                if self.compiler is None:
                    self.compiler = nvrtc_compiler()
            code, mangled = self.compiler(source, f"mlx::core::cu::{build.kernel_name}")
            path = module_path(self.directory, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            # the kernel names first: MLX takes the code's presence to mean both are there
            _write(path.with_suffix(".txt"), f"mlx::core::cu::{build.kernel_name}\t{mangled}\n".encode())
            _write(path, code)
            with self._lock:
                self.compiled += 1
        except Exception as e:  # noqa: BLE001 - MLX compiles what this could not
            with self._lock:
                self.failed += 1
                first = self.failed == 1
            if first:
                log.warning("kernel cache: MLX compiles %s itself (%s)", build.kernel_name, e)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def module_files(directory: Path | None) -> int | None:
    """Compiled modules in a kernel cache directory (None: no directory): MLX writes `<module>.ptx` there for
    each module it compiles, its own and the engine's kernels alike (this cache writes those first), so a count
    that grows after ready is compilations that requests waited for."""
    if directory is None or not directory.is_dir():
        return None
    return sum(1 for _ in directory.rglob("*.ptx"))
