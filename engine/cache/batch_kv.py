"""Growing KV cache for a batch of rows at different positions.

Rows are right-aligned in one [B, H, S, D] buffer: row b's tokens occupy
columns [left_padding[b], idx), so the token being decoded is one column for
every row and a single write position `idx` serves the batch. Each row keeps
its own absolute position (`offset`, for RoPE) and a boolean mask hides its
padding. Layout, growth and the trim of shared padding on `filter` follow
mlx-lm's BatchKVCache, which the same-B oracle runs.

The buffers are kept as a list of "parts" that share the token axis (keys and
values here; packed codes, scales and biases in the quantized subclass), so
alignment, filtering and extraction are written once for both.
Padding lives in Python ints, so no operation here waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.cache.kv import KVCache, owned_copies
from engine.masks import causal_mask


def roll_rows(x: mx.array, shifts: Sequence[int], axis: int = 2) -> mx.array:
    """Roll each row b of x right by shifts[b] along `axis` (mlx-lm's dynamic_roll)."""
    n = x.shape[axis]
    tail = (None,) * (x.ndim - axis)
    idx = (mx.arange(n)[(..., *tail[:-1])] - mx.array(list(shifts))[:, None][(..., *tail)]) % n
    return mx.take_along_axis(x, idx, axis=axis)


class BatchKVCache:
    step = 256

    def __init__(self, left_padding: Sequence[int]):
        self.parts: list[mx.array] | None = None
        self.left_padding = list(left_padding)
        self.idx = 0
        self._offset_array: mx.array | None = None
        self._right_padding: list[int] | None = None

    # ------------------------------------------------- what a subclass stores

    def _new_parts(self, keys: mx.array, values: mx.array) -> list[mx.array]:
        return [keys, values]

    def _fetched(self, parts: list[mx.array]):
        return parts[0], parts[1]

    @staticmethod
    def _single_parts(cache: KVCache) -> list[mx.array] | None:
        return None if cache.keys is None else [cache.keys, cache.values]

    def _single(self, parts: list[mx.array]) -> KVCache:
        cache = KVCache()
        cache.keys, cache.values = parts
        cache.offset = parts[0].shape[2]
        return cache

    # --------------------------------------------------------------- shape

    @property
    def keys(self) -> mx.array | None:
        return None if self.parts is None else self.parts[0]

    @property
    def batch_size(self) -> int:
        return len(self.left_padding)

    @property
    def offsets(self) -> list[int]:
        """Each row's absolute position: tokens it holds."""
        return [self.idx - p for p in self.left_padding]

    @property
    def offset(self) -> mx.array:
        """RoPE offsets: each row's position, one array per forward (read before the update)."""
        if self._offset_array is None:
            self._offset_array = mx.array(self.offsets)
        return self._offset_array

    def _changed(self) -> None:
        self._offset_array = None

    # --------------------------------------------------------------- forward

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        new = self._new_parts(keys, values)
        prev, n = self.idx, keys.shape[2]
        if self.parts is None or prev + n > self.parts[0].shape[2]:
            size = ((self.step + n - 1) // self.step) * self.step
            grown = [mx.zeros((*p.shape[:2], size, p.shape[3]), p.dtype) for p in new]
            if self.parts is None:
                self.parts = grown
            else:
                if prev % self.step != 0:
                    self.parts = [p[..., :prev, :] for p in self.parts]
                self.parts = [mx.concatenate([p, g], axis=2) for p, g in zip(self.parts, grown)]
        self.idx += n
        self._changed()
        for p, x in zip(self.parts, new):
            p[..., prev : self.idx, :] = x
        return self.fetch()

    def fetch(self):
        return self._fetched([p[..., : self.idx, :] for p in self.parts])

    def prepare(self, lengths: Sequence[int], right_padding: Sequence[int]) -> None:
        """Before a right-padded prefill chunk: remember the padding to move left afterwards."""
        if max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self) -> None:
        """After it: roll each row right by its padding, so the padding becomes left padding."""
        if self._right_padding is not None:
            self.parts = [roll_rows(p, self._right_padding) for p in self.parts]
            self.left_padding = [p + r for p, r in zip(self.left_padding, self._right_padding)]
            self._right_padding = None
            self._changed()

    def make_mask(self, n: int, window_size: int | None = None) -> mx.array:
        # Always an explicit boolean mask, also with no padding and at n = 1: that is
        # mlx-lm's batched graph, and on CUDA the unmasked attention kernel rounds
        # differently (measured on the H200: 1-ULP logit differences in bf16).
        return causal_mask(n, self.idx, window_size=window_size, left_padding=mx.array(self.left_padding))

    # ---------------------------------------------------------- batch edits

    @classmethod
    def merge(cls, caches: Sequence[KVCache], **kwargs) -> BatchKVCache:
        """Right-align single-row caches into one batch (mlx-lm's merge)."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        out = cls([longest - n for n in lengths], **kwargs)
        if longest == 0:
            return out
        singles = [cls._single_parts(c) for c in caches]
        ref = next(s for s in singles if s is not None)
        out.parts = [mx.zeros((len(caches), p.shape[1], longest, p.shape[3]), dtype=p.dtype) for p in ref]
        for i, (pad, n, single) in enumerate(zip(out.left_padding, lengths, singles)):
            if single is None:
                continue
            for dst, src in zip(out.parts, single):
                dst[i : i + 1, :, pad : pad + n] = src[..., :n, :]
        out.idx = longest
        return out

    def extend(self, other: BatchKVCache) -> None:
        """Append other's rows below ours, right-aligning both to the longer one."""
        self._changed()
        if self.parts is None and other.parts is None:
            self.left_padding += other.left_padding
            return
        longest = max(self.idx, other.idx)
        ref = self.parts if self.parts is not None else other.parts
        width = max(c.parts[0].shape[2] for c in (self, other) if c.parts is not None)

        def aligned(c: BatchKVCache) -> list[mx.array]:
            parts = c.parts or [mx.zeros((c.batch_size, r.shape[1], 0, r.shape[3]), dtype=r.dtype) for r in ref]
            left = longest - c.idx
            right = width - parts[0].shape[2] - left
            if right < 0:
                parts = [p[..., :right, :] for p in parts]
                right = 0
            if left or right:
                parts = [mx.pad(p, [(0, 0), (0, 0), (left, right), (0, 0)]) for p in parts]
            return parts

        self.parts = [mx.concatenate([a, b]) for a, b in zip(aligned(self), aligned(other))]
        self.left_padding = [p + longest - self.idx for p in self.left_padding] + [
            p + longest - other.idx for p in other.left_padding
        ]
        self.idx = longest

    def filter(self, keep: Sequence[int], trim: bool = True) -> None:
        """Keep these rows (in this order), then (`trim`) drop padding every survivor shares."""
        self._changed()
        if self.parts is not None:
            rows = mx.array(list(keep))
            self.parts = [p[rows] for p in self.parts]
        self.left_padding = [self.left_padding[i] for i in keep]
        shared = min(self.left_padding) if self.left_padding and trim else 0
        if shared > 0:
            if self.parts is not None:
                self.parts = [p[..., shared:, :] for p in self.parts]
            self.idx -= shared
            self.left_padding = [p - shared for p in self.left_padding]

    def trim_rows(self, drops: Sequence[int]) -> None:
        """Drop the last drops[b] tokens of each row b (rejected drafts after a verify forward).

        The write index moves back by the smallest drop, which every row can
        spare; each row then rolls right by what it drops beyond that, so its
        dropped tokens wrap to the left and become padding. Equal drops roll
        nothing."""
        if len(drops) != self.batch_size or min(drops, default=0) < 0:
            raise ValueError(f"drops must be {self.batch_size} counts >= 0, got {list(drops)}")
        if not drops:
            return
        shared = min(drops)
        if any(d > o for d, o in zip(drops, self.offsets)):
            raise ValueError(f"cannot drop {list(drops)} tokens from rows holding {self.offsets}")
        self.idx -= shared
        roll = [d - shared for d in drops]
        if max(roll) > 0:
            for p in self.parts:
                p[..., : self.idx, :] = roll_rows(p[..., : self.idx, :], roll)
            self.left_padding = [p + r for p, r in zip(self.left_padding, roll)]
        self._changed()

    def extract(self, row: int):
        """One row as a fresh single-row cache: copies that own their bytes, holding nothing of the batch."""
        start = self.left_padding[row]
        return self._single(owned_copies([p[row : row + 1, :, start : self.idx] for p in self.parts]))

    # ------------------------------------------------------------- reporting

    @property
    def state(self):
        return [] if self.parts is None else [p[..., : self.idx, :] for p in self.parts]

    def size(self) -> int:
        return self.idx

    @property
    def nbytes(self) -> int:
        return 0 if self.parts is None else sum(p.nbytes for p in self.parts)
