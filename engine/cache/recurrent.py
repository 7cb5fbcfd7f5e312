"""Recurrent state for Gated DeltaNet layers: the causal-conv tail and the f32 delta-rule state.

Slot 0 holds the last (kernel - 1) conv inputs, slot 1 the [B, Hv, Dv, Dk]
recurrent state. Neither can be trimmed: rewinding means restoring a
snapshot (speculative decoding does that).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


class RecurrentCache:
    def __init__(self, size: int = 2):
        self.slots: list[Optional[mx.array]] = [None] * size
        self.offset = 0
        # Batch metadata (None at B=1): tokens of left padding, and valid lengths.
        self.left_padding: Optional[mx.array] = None
        self.lengths: Optional[mx.array] = None

    def __getitem__(self, i: int) -> Optional[mx.array]:
        return self.slots[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.slots[i] = value

    def advance(self, n: int) -> None:
        self.offset += n
        if self.lengths is not None:
            self.lengths = self.lengths - n
        if self.left_padding is not None:
            self.left_padding = self.left_padding - n

    def make_mask(self, n: int):
        pos = mx.arange(n)
        mask = None
        if self.left_padding is not None:
            mask = pos >= self.left_padding[:, None]
        if self.lengths is not None:
            in_length = pos < self.lengths[:, None]
            mask = in_length if mask is None else (mask & in_length)
        return mask

    @property
    def state(self):
        return [s for s in self.slots if s is not None]

    def snapshot(self) -> list[Optional[mx.array]]:
        return list(self.slots)

    def restore(self, slots: list[Optional[mx.array]], offset: int) -> None:
        self.slots = list(slots)
        self.offset = offset

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots if s is not None)
