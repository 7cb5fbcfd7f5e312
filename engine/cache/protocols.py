"""What every cache kind answers to, so code that handles caches names the methods it relies on.

`Cache` is one row's cache of one layer (the serial lane, the prompt cache's entries); `BatchCache` one
layer's cache of a batch of rows (the continuous lane), which the runner merges from single rows,
extends, filters and extracts rows from. A recurrent layer's cache is both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Cache(Protocol):
    """One row of one layer."""

    @property
    def state(self) -> Any:
        """Every array held, for `mx.eval`."""

    @property
    def nbytes(self) -> int: ...

    def is_trimmable(self) -> bool:
        """Whether `trim` can drop tokens (a recurrent state cannot be rewound)."""

    def trim(self, n: int) -> int:
        """Drop the last n tokens; how many were dropped."""

    def make_mask(self, n: int) -> Any:
        """The attention mask of a forward of n tokens (None, "causal" or an array)."""


@runtime_checkable
class BatchCache(Protocol):
    """One layer, many rows: right-padded prefill chunks, left-padded rows."""

    @property
    def state(self) -> Any: ...

    @property
    def nbytes(self) -> int: ...

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchCache:
        """One batch of the single-row caches, in order."""

    def make_mask(self, n: int) -> Any: ...

    def prepare(self, lengths: Sequence[int], right_padding: Sequence[int]) -> None:
        """Before a right-padded prefill chunk."""

    def finalize(self) -> None:
        """After it: the padding moves to the left."""

    def extend(self, other: Any) -> None:
        """Append another batch's rows."""

    def filter(self, keep: Sequence[int], trim: bool = True) -> None:
        """Keep these rows, in this order (`trim`: then drop padding they all share, where a kind has it)."""

    def extract(self, row: int) -> Cache:
        """One row as a single-row cache (a copy)."""
