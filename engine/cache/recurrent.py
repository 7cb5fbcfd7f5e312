"""Recurrent state for Gated DeltaNet layers: the causal-conv tail and the f32 delta-rule state.

Slot 0 holds the last (kernel - 1) conv inputs, slot 1 the [B, Hv, Dv, Dk]
recurrent state. Neither can be trimmed. Speculative decoding rewinds them
either from a trace (`start_trace`: the next forward records its conv input
and the state after every token, and `keep_traced` picks the point) or by
restoring a snapshot and replaying the kept tokens. The prompt cache's block
snapshots come from inside a forward (`keep_at`: the next forward records its
conv input and the state after the token counts asked for, per row, and
`kept` hands one of them over as a cache). In a batch the rows simply stack
on axis 0; there is no token axis to align, only left padding to mask while
a padded row's padding is still ahead of it (mlx-lm's ArraysCache rules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from engine.cache.kv import owned_copies


@dataclass
class Trace:
    """What the forwards since `start_trace` recorded over their n tokens in all:
    the conv inputs [conv tail before them; n inputs] and the state after each token."""

    conv_input: mx.array | None = None
    states: list = field(default_factory=list)

    def record_conv(self, conv_input: mx.array, new: int) -> None:
        if self.conv_input is None:
            self.conv_input = conv_input
        else:
            self.conv_input = mx.concatenate([self.conv_input, conv_input[:, -new:, :]], axis=1)


@dataclass
class Marks:
    """What the forward after `keep_at` keeps: per row, the token counts into it asked for (`at`); the layer
    records its conv inputs [conv tail before the forward; its inputs] and, for each count any row asked
    for, the batch's state after that many tokens (`states`, filled by the rule)."""

    at: tuple[tuple[int, ...], ...]
    conv_input: mx.array | None = None
    states: dict[int, mx.array | None] = field(default_factory=dict)


class RecurrentCache:
    def __init__(self, size: int = 2):
        self.slots: list[mx.array | None] = [None] * size
        self.offset = 0
        # Batch metadata (None for a lone serial row): tokens of left padding
        # still ahead of each row, and valid lengths of right-padded inputs.
        self.left_padding: list[int] | None = None
        self.lengths: list[int] | None = None
        self.trace: Trace | None = None  # set by start_trace, filled by the layer's next forward
        self.marks: Marks | None = None  # set by keep_at, filled by the layer's next forward

    def __getitem__(self, i: int) -> mx.array | None:
        return self.slots[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.slots[i] = value

    @property
    def batch_size(self) -> int:
        for s in self.slots:
            if s is not None:
                return s.shape[0]
        return len(self.left_padding) if self.left_padding is not None else 1

    def advance(self, n: int) -> None:
        self.offset += n
        if self.lengths is not None:
            self.lengths = [x - n for x in self.lengths]
        if self.left_padding is not None:
            self.left_padding = [p - n for p in self.left_padding]

    def make_mask(self, n: int) -> mx.array | None:
        # A row whose padding is all behind it (p <= 0) is unmasked; an all-true
        # mask would select every element unchanged, so None is the same math.
        has_padding = self.left_padding is not None and max(self.left_padding) > 0
        if not has_padding and self.lengths is None:
            return None
        pos = mx.arange(n)
        mask = None
        if has_padding:
            mask = pos >= mx.array(self.left_padding)[:, None]
        if self.lengths is not None:
            in_length = pos < mx.array(self.lengths)[:, None]
            mask = in_length if mask is None else (mask & in_length)
        return mask

    # ---------------------------------------------------------- batch edits

    def prepare(self, lengths: Sequence[int], right_padding: Sequence[int]) -> None:
        """Before a right-padded prefill chunk: mask each row past its length."""
        self.lengths = list(lengths)

    def finalize(self) -> None:
        self.lengths = None
        self.left_padding = None

    @classmethod
    def merge(cls, caches: Sequence[RecurrentCache]) -> RecurrentCache:
        """Stack single-row states into one batch."""
        out = cls(len(caches[0].slots))
        if all(c.slots[0] is None for c in caches):
            out.left_padding = [0] * len(caches)
            return out
        for i in range(len(out.slots)):
            ref = next(c.slots[i] for c in caches if c.slots[i] is not None)
            rows = [c.slots[i] if c.slots[i] is not None else mx.zeros((1, *ref.shape[1:]), ref.dtype) for c in caches]
            out.slots[i] = mx.concatenate(rows)
        return out

    def extend(self, other: RecurrentCache) -> None:
        a, b = self.batch_size, other.batch_size

        def cat(x: mx.array | None, y: mx.array | None) -> mx.array | None:
            if x is None and y is None:
                return None
            ref = x if x is not None else y
            x = x if x is not None else mx.zeros((a, *ref.shape[1:]), ref.dtype)
            y = y if y is not None else mx.zeros((b, *ref.shape[1:]), ref.dtype)
            return mx.concatenate([x, y])

        def cat_meta(x: list[int] | None, y: list[int] | None) -> list[int] | None:
            if x is None and y is None:
                return None
            return (x if x is not None else [0] * a) + (y if y is not None else [0] * b)

        self.slots = [cat(x, y) for x, y in zip(self.slots, other.slots)]
        self.left_padding = cat_meta(self.left_padding, other.left_padding)
        self.lengths = cat_meta(self.lengths, other.lengths)

    def filter(self, keep: Sequence[int], trim: bool = True) -> None:
        """Keep these rows (in this order); state has no padding to trim (`trim` for the batch caches' sake)."""
        rows = mx.array(list(keep))
        self.slots = [s[rows] if s is not None else None for s in self.slots]
        if self.left_padding is not None:
            self.left_padding = [self.left_padding[i] for i in keep]
        if self.lengths is not None:
            self.lengths = [self.lengths[i] for i in keep]

    def extract(self, row: int) -> RecurrentCache:
        """One row's state as a fresh cache (copies that own their bytes, holding nothing of the batch)."""
        out = RecurrentCache(len(self.slots))
        copies = iter(owned_copies([s[row : row + 1] for s in self.slots if s is not None]))
        out.slots = [next(copies) if s is not None else None for s in self.slots]
        return out

    # ------------------------------------------------------------ snapshots

    @property
    def state(self):
        return [s for s in self.slots if s is not None]

    def snapshot(self) -> list[mx.array | None]:
        return list(self.slots)

    def restore(self, slots: list[mx.array | None], offset: int) -> None:
        self.slots = list(slots)
        self.offset = offset

    def start_trace(self) -> None:
        self.trace = Trace()

    def keep_traced(self, kept: int) -> None:
        """After the traced forward of n tokens, hold the state after only the first `kept` (1 <= kept <= n)."""
        trace, self.trace = self.trace, None
        n = len(trace.states)
        if not 1 <= kept <= n:
            raise ValueError(f"kept must be in [1, {n}], got {kept}")
        width = trace.conv_input.shape[1] - n
        self.slots[0] = mx.contiguous(trace.conv_input[:, kept : kept + width, :])
        self.slots[1] = trace.states[kept - 1]
        self.offset -= n - kept

    def keep_traced_rows(self, kept: Sequence[int]) -> None:
        """`keep_traced` per row: row b holds the state after the first kept[b] tokens of the traced forward."""
        trace, self.trace = self.trace, None
        n = len(trace.states)
        if len(kept) != self.batch_size or not all(1 <= k <= n for k in kept):
            raise ValueError(f"kept must be {self.batch_size} counts in [1, {n}], got {list(kept)}")
        width = trace.conv_input.shape[1] - n
        self.slots[0] = mx.concatenate([trace.conv_input[b : b + 1, k : k + width, :] for b, k in enumerate(kept)])
        self.slots[1] = mx.concatenate([trace.states[k - 1][b : b + 1] for b, k in enumerate(kept)])

    def keep_at(self, at: Sequence[Sequence[int]]) -> None:
        """The next forward records, for each row b, the conv tail and the state after each of its first n
        tokens for n in at[b] (1 <= n <= the row's tokens in it), for `kept`; `unmark` ends it."""
        rows = tuple(tuple(r) for r in at)
        self.marks = Marks(rows, states={n: None for r in rows for n in r})

    def kept(self, row: int, n: int) -> RecurrentCache:
        """After the forward `keep_at` asked for, row `row` as it was after the first `n` tokens of that forward,
        as a fresh single-row cache (copies that own their bytes)."""
        marks = self.marks
        state = marks.states.get(n) if marks is not None and n in marks.at[row] else None
        if state is None or marks.conv_input is None:
            raise ValueError(f"row {row} recorded no state after {n} tokens of the last forward")
        width = self.slots[0].shape[1]
        out = RecurrentCache(len(self.slots))
        out.slots[0], out.slots[1] = owned_copies(
            [marks.conv_input[row : row + 1, n : n + width], state[row : row + 1]]
        )
        out.offset = self.offset - (marks.conv_input.shape[1] - width - n)
        return out

    def unmark(self) -> None:
        self.marks = None

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots if s is not None)
