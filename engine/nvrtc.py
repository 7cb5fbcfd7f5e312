"""NVRTC through ctypes: CUDA C++ source to a cubin, with the options MLX's CUDA backend uses.

Also a command (`python -m engine.nvrtc --arch 9.0 --kernel NAME --include DIR ...`, the source on stdin;
the kernel's mangled name, a newline and the code on stdout), so that compilations run in processes of
their own: NVRTC compiles one program at a time per process, so threads of one process would wait on each
other. Imports nothing of MLX or of the engine's packages.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path

# What NVRTC reads for MLX's device header: the toolkit headers it includes; the engine's kernels use
# nothing of MLX's own.
UTILS_HEADER = (
    "#pragma once\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/array>\n"
    "#include <cuda/std/limits>\n#include <cuda/std/tuple>\n#define MAX_NDIM 10\n#define WARP_SIZE 32\n"
    "#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"
)
LIBRARIES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class Nvrtc:
    """A source to cubin (or PTX where NVRTC cannot target the device), with MLX's options."""

    def __init__(self, include_dirs: Sequence[Path], arch: tuple[int, int], library: str | None = None):
        self.lib = _load_first((library,) if library else LIBRARIES)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.sass = major.value > 11 or (major.value == 11 and minor.value >= 8)  # MLX's compiler_supports_device_sass
        cc = f"{arch[0]}{arch[1]}{'a' if arch[0] >= 9 else ''}"
        self.options = [
            b"--device-as-default-execution-space",
            f"--gpu-architecture={'sm' if self.sass else 'compute'}_{cc}".encode(),
        ] + [f"--include-path={d}".encode() for d in include_dirs]

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, kernel: str) -> tuple[bytes, str]:
        """(the compiled code, the kernel's mangled name)."""
        lib, prog = self.lib, ctypes.c_void_p()
        names = (ctypes.c_char_p * 1)(b"mlx/backend/cuda/device/utils.cuh")
        headers = (ctypes.c_char_p * 1)(UTILS_HEADER.encode())
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 1, headers, names),
            "nvrtcCreateProgram",
        )
        try:
            self._check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(self.options))(*self.options)
            if lib.nvrtcCompileProgram(prog, len(self.options), opts) != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, text)
                raise RuntimeError(f"NVRTC could not compile {kernel}: {text.value.decode(errors='replace')[:2000]}")
            mangled = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(mangled)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            get_size, get = (
                (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if self.sass else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
            )
            self._check(get_size(prog, ctypes.byref(size)), "size")
            code = ctypes.create_string_buffer(size.value)
            self._check(get(prog, code), "code")
            return code.raw, mangled.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def loaded_library() -> str | None:
    """The path of the NVRTC library this process has loaded (MLX's CUDA backend loads one), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libnvrtc.so" in path:
                    return path
    except OSError:
        pass
    return None


def _load_first(names: Sequence[str]) -> ctypes.CDLL:
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"none of {', '.join(names)} loads")


def device_arch() -> tuple[int, int]:
    """The compute capability of CUDA device 0 (the driver's)."""
    cuda = _load_first(("libcuda.so.1", "libcuda.so"))
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    cuda.cuInit(0)
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return major.value, minor.value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile CUDA source from stdin with NVRTC (MLX's options).")
    p.add_argument("--arch", required=True, help="compute capability as MAJOR.MINOR, e.g. 9.0")
    p.add_argument("--kernel", required=True, help="the kernel's name expression (its mangled name is printed)")
    p.add_argument("--include", action="append", default=[], help="an include directory (repeatable)")
    p.add_argument("--library", help="the NVRTC library's path (default: the first of LIBRARIES that loads)")
    args = p.parse_args(argv)
    try:
        major, minor = (int(v) for v in args.arch.split("."))
        code, mangled = Nvrtc([Path(d) for d in args.include], (major, minor), args.library).compile(
            sys.stdin.buffer.read().decode(), args.kernel
        )
    except (OSError, RuntimeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    sys.stdout.buffer.write(mangled.encode() + b"\n" + code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
