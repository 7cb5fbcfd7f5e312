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
"""

from __future__ import annotations

import mlx.core as mx


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


def cuda_kernel(*, name: str, input_names: list[str], output_names: list[str], source: str, header: str = "",
                shared_memory: int = 0):  # fmt: skip
    """`mx.fast.cuda_kernel` on the compacted source and header (`shared_memory`: its dynamic bytes)."""
    return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                               source=compact(source), header=compact(header), shared_memory=shared_memory)  # fmt: skip
