"""Deterministic random weights, produced in row chunks.

Every tensor draws from its own PCG64 stream seeded by (seed, tensor name), so
tensors can be made in any order and the same name + seed always gives the
same bytes. Values come from raw generator bits (`random_raw`), never from a
distribution method whose algorithm numpy might change.

Float matrices are uniform with std 1/sqrt(fan_in) (embeddings: std 1).
Quantized matrices are drawn directly as random affine codes with per-group
scales, which is what a 4-bit model looks like to the kernels and keeps the
27B synthesis fast.

The UTF-8 guard. A token whose text alone is not complete UTF-8 (a lone
continuation byte, half of a CJK character) decodes to U+FFFD, and a streaming
detokenizer holds such text back; random weights would emit them often. So
the weights carry a constant feature that the head turns into a large
negative logit for those ids (and for the special tokens):
  - embedding columns [0, w) hold the same +-c pattern for every token;
  - every projection that writes into the residual stream (o_proj,
    down_proj, out_proj) has zero output rows [0, w), so the residual keeps
    exactly that pattern in those dimensions through every layer;
  - the final norm multiplies those dimensions by GUARD_GAIN;
  - head rows of suppressed ids hold -pattern in columns [0, w), other rows
    hold (near) zero there.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from engine.registry import ModelSpec, Quantization
from engine.synth import plan as P
from engine.synth.safetensors_writer import TensorEntry

GUARD_GAIN = 16.0
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Guard:
    width: int  # dimensions [0, width) of the residual stream carry the feature
    gain: float
    suppressed: np.ndarray  # bool, one per vocabulary id
    pattern: np.ndarray  # +1 / -1, length width

    @classmethod
    def make(cls, spec: ModelSpec, suppressed_ids: tuple[int, ...]) -> Guard:
        g = spec.geometry
        width = min(64, g.hidden_size // 8)
        if spec.quantization is not None:
            width = min(width, spec.quantization.group_size)
        mask = np.zeros(g.vocab_size, dtype=bool)
        mask[list(suppressed_ids)] = True
        pattern = np.where(np.arange(width) % 2 == 0, 1.0, -1.0).astype(np.float32)
        return cls(width=width, gain=GUARD_GAIN, suppressed=mask, pattern=pattern)


def _rng(seed: int, name: str) -> np.random.Generator:
    words = np.frombuffer(hashlib.sha256(name.encode()).digest(), dtype=np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *words.tolist()])))


def _uniform(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    """n float32 values in [low, high), 24 bits each, from raw generator output."""
    raw = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
    u = (raw >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    return (np.float32(low) + u * np.float32(high - low)).astype(np.float32)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return to_bf16_bits(x) if dtype == "bfloat16" else x.astype(np.float32)


_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16"}


def _row_chunks(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


# ---------------------------------------------------------------- float path


def _float_std(t: P.TensorPlan) -> float:
    return 1.0 if t.role == P.EMBED else 1.0 / math.sqrt(t.shape[-1])


def _float_matrix(t: P.TensorPlan, seed: int, guard: Guard) -> Iterator[np.ndarray]:
    rows, cols = t.shape
    a = math.sqrt(3.0) * _float_std(t)
    rng = _rng(seed, t.name)
    w = guard.width
    for start, stop in _row_chunks(rows, cols):
        x = _uniform(rng, (stop - start) * cols, -a, a).reshape(stop - start, cols)
        if t.role == P.WRITER and start < w:
            x[: w - start] = 0.0
        elif t.role == P.EMBED:
            x[:, :w] = guard.pattern
        elif t.role == P.HEAD:
            bad = guard.suppressed[start:stop]
            x[:, :w] = 0.0
            x[bad, :w] = -guard.pattern
        yield _cast(x, t.dtype)


def _vector(t: P.TensorPlan, seed: int, guard: Guard) -> np.ndarray:
    n = math.prod(t.shape)
    rng = _rng(seed, t.name)
    if t.role in (P.NORM, P.FINAL_NORM):
        x = _uniform(rng, n, 0.9, 1.1)
    elif t.role in (P.NORM_OFFSET, P.FINAL_NORM_OFFSET):
        x = _uniform(rng, n, -0.1, 0.1)
    elif t.role == P.CONV:
        a = math.sqrt(3.0 / t.shape[1])
        x = _uniform(rng, n, -a, a)
    elif t.role == P.A_LOG:
        x = np.log(_uniform(rng, n, 1.0, 16.0))
    elif t.role == P.DT_BIAS:
        x = _uniform(rng, n, 0.5, 1.5)
    elif t.role == P.BIAS:
        x = _uniform(rng, n, -0.05, 0.05)
    else:
        raise ValueError(f"no vector rule for role {t.role}")
    if t.role == P.FINAL_NORM:
        x[: guard.width] = guard.gain
    elif t.role == P.FINAL_NORM_OFFSET:
        x[: guard.width] = guard.gain - 1.0
    return _cast(x.reshape(t.shape).astype(np.float32), t.dtype)


# ------------------------------------------------------------ quantized path


@dataclass(frozen=True)
class _QuantLayout:
    q: Quantization
    rows: int
    cols: int

    @property
    def levels(self) -> int:
        return (1 << self.q.bits) - 1

    @property
    def words_per_row(self) -> int:
        return self.cols * self.q.bits // 32

    @property
    def groups(self) -> int:
        return self.cols // self.q.group_size

    def pack(self, codes: np.ndarray) -> np.ndarray:
        """Codes (..., n) -> uint32 words, element j at bits [b*j, b*(j+1)) of its word."""
        per_word = 32 // self.q.bits
        c = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, per_word)
        shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(self.q.bits)).astype(np.uint32)
        return np.bitwise_or.reduce(c << shifts, axis=-1).astype(np.uint32)


def _base_scale(t: P.TensorPlan, layout: _QuantLayout) -> float:
    # Uniform codes in [0, L] have std L' = sqrt(((L+1)^2 - 1) / 12) in units of the scale.
    code_std = math.sqrt(((layout.levels + 1) ** 2 - 1) / 12.0)
    return _float_std(t) / code_std


def _quant_scales(t: P.TensorPlan, layout: _QuantLayout, seed: int, guard: Guard) -> tuple[np.ndarray, np.ndarray]:
    """Per-group (scales, biases) for the whole matrix, float32 (small: one per group)."""
    base = _base_scale(t, layout)
    rng = _rng(seed, t.name + ".scales")
    jitter = _uniform(rng, layout.rows * layout.groups, 0.75, 1.25).reshape(layout.rows, layout.groups)
    scales = (base * jitter).astype(np.float32)
    if t.role in (P.EMBED, P.HEAD):
        scales[:, 0] = base  # the guard group: exact, equal for all rows
    biases = (-(layout.levels / 2.0) * scales).astype(np.float32)
    if t.role == P.WRITER:
        scales[: guard.width] = 0.0
        biases[: guard.width] = 0.0
    elif t.role == P.HEAD:
        scales[guard.suppressed, 0] = 2.0 / layout.levels  # values in [-1, 1]
        biases[guard.suppressed, 0] = -1.0
    return scales, biases


def _quant_codes(t: P.TensorPlan, layout: _QuantLayout, seed: int, guard: Guard) -> Iterator[np.ndarray]:
    rng = _rng(seed, t.name + ".codes")
    w, gsize, levels = guard.width, layout.q.group_size, layout.levels
    mid = levels // 2
    on = np.where(guard.pattern > 0, levels, 0)
    guard_words = {
        "embed": layout.pack(on),
        "good": layout.pack(np.full(w, mid)),
        # value = -1 + code * 2/levels, so code levels - on gives -pattern
        "bad": layout.pack(np.concatenate([levels - on, np.full(gsize - w, mid)])),
    }
    nw = w * layout.q.bits // 32
    for start, stop in _row_chunks(layout.rows, layout.words_per_row):
        n = (stop - start) * layout.words_per_row
        words = rng.bit_generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
        words = words.reshape(stop - start, layout.words_per_row).copy()
        if t.role == P.EMBED:
            words[:, :nw] = guard_words["embed"]
        elif t.role == P.HEAD:
            bad = guard.suppressed[start:stop]
            words[~bad, :nw] = guard_words["good"]
            words[bad, : gsize * layout.q.bits // 32] = guard_words["bad"]
        yield words


def _quantized_entries(t: P.TensorPlan, q: Quantization, seed: int, guard: Guard) -> list[TensorEntry]:
    rows, cols = t.shape
    layout = _QuantLayout(q, rows, cols)
    st = _ST_DTYPE[t.dtype]

    def part(index: int):
        def produce() -> Iterator[np.ndarray]:
            yield _cast(_quant_scales(t, layout, seed, guard)[index], t.dtype)

        return produce

    return [
        TensorEntry(
            f"{t.name}.weight", "U32", (rows, layout.words_per_row), lambda: _quant_codes(t, layout, seed, guard)
        ),
        TensorEntry(f"{t.name}.scales", st, (rows, layout.groups), part(0)),
        TensorEntry(f"{t.name}.biases", st, (rows, layout.groups), part(1)),
    ]


def is_quantized(t: P.TensorPlan, spec: ModelSpec) -> bool:
    q = spec.quantization
    return q is not None and t.is_matrix and t.shape[-1] % q.group_size == 0


def tensor_entries(t: P.TensorPlan, spec: ModelSpec, seed: int, guard: Guard) -> list[TensorEntry]:
    """The safetensors entries for one planned tensor (three when quantized)."""
    if is_quantized(t, spec):
        assert spec.quantization is not None
        return _quantized_entries(t, spec.quantization, seed, guard)
    st = _ST_DTYPE[t.dtype]
    if t.is_matrix:
        return [TensorEntry(f"{t.name}.weight", st, t.shape, lambda: _float_matrix(t, seed, guard))]
    return [TensorEntry(t.name, st, t.shape, lambda: iter([_vector(t, seed, guard)]))]


def planned_weight_bytes(spec: ModelSpec) -> int:
    """Bytes of tensor data the artifact will hold (headers aside), without making it."""
    total = 0
    for t in P.tensor_plan(spec):
        itemsize = 4 if t.dtype == "float32" else 2
        if is_quantized(t, spec):
            q = spec.quantization
            rows, cols = t.shape
            total += rows * cols * q.bits // 8 + 2 * rows * (cols // q.group_size) * itemsize
        else:
            total += math.prod(t.shape) * itemsize
    return total
