"""Stream tensors into a safetensors file without holding them all in memory.

The header (names, dtypes, shapes, offsets) is known before any data is made,
so each tensor's bytes are produced and written in turn. The sha256 of the
whole file is computed while writing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPE_BYTES = {"F32": 4, "BF16": 2, "U32": 4, "F16": 2}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors dtype: F32, BF16, U32
    shape: tuple[int, ...]
    # Yields the tensor's bytes in row-major order, in chunks.
    produce: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class WrittenFile:
    path: Path
    sha256: str
    nbytes: int


def _header(entries: Iterable[TensorEntry], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(path: Path, entries: list[TensorEntry], metadata: dict[str, str]) -> WrittenFile:
    digest = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        head = _header(entries, metadata)
        f.write(head)
        digest.update(head)
        total += len(head)
        for e in entries:
            written = 0
            for chunk in e.produce():
                buf = np.ascontiguousarray(chunk).tobytes()
                f.write(buf)
                digest.update(buf)
                written += len(buf)
            assert written == e.nbytes, f"{e.name}: wrote {written} bytes, expected {e.nbytes}"
            total += written
    return WrittenFile(path=path, sha256=digest.hexdigest(), nbytes=total)
