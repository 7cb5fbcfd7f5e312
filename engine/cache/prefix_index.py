"""Stored token sequences in sorted order, walked from the ones sharing the longest prefix with a query.

The prompt cache asks, for every new prompt, which stored entry it shares the most tokens with. Comparing the
prompt with each entry costs a few microseconds an entry (a numpy comparison each); with a thousand entries that
share a system prompt, ~10 ms a lookup on the engine thread. In sorted order the entries sharing the most
tokens with a query lie next to where the query would sort, and the common prefix with each entry further out is
the smaller of the one before it and the common prefix of that neighbouring pair (kept as entries come and go).
So one bisection and two comparisons find the first candidates, and each further one costs a `min`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

import numpy as np

Key = tuple[int, ...]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixIndex:
    def __init__(self):
        self._keys: list[Key] = []  # sorted
        self._ids: list[np.ndarray] = []  # each key's tokens as an array
        self._values: list[Any] = []  # what each key stands for (handed back without hashing the key again)
        self._adjacent: list[int] = []  # [i]: the common prefix of keys i and i + 1

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()
        self._ids.clear()
        self._values.clear()
        self._adjacent.clear()

    def add(self, key: Key, ids: np.ndarray, value: Any = None) -> None:
        p = bisect_left(self._keys, key)
        if p < len(self._keys) and self._keys[p] == key:
            raise ValueError("key is indexed already")
        self._keys.insert(p, key)
        self._ids.insert(p, ids)
        self._values.insert(p, value)
        if p > 0:  # the pair (p - 1, p + 1) becomes (p - 1, p) and (p, p + 1)
            self._adjacent[p - 1 : p] = [common_prefix(self._ids[p - 1], ids)]
        if p + 1 < len(self._keys):
            self._adjacent.insert(p, common_prefix(ids, self._ids[p + 1]))

    def remove(self, key: Key) -> None:
        p = bisect_left(self._keys, key)
        if p == len(self._keys) or self._keys[p] != key:
            raise KeyError(key)
        last = len(self._keys) - 1
        del self._keys[p], self._ids[p], self._values[p]
        if 0 < p < last:  # neighbours on both sides: in sorted order their common prefix is the smaller one
            self._adjacent[p - 1 : p + 1] = [min(self._adjacent[p - 1], self._adjacent[p])]
        elif last > 0:  # the first or the last key went, and its one pair with it
            del self._adjacent[p - 1 if p else 0]

    def nearest(self, key: Key, ids: np.ndarray) -> Iterator[tuple[Any, int]]:
        """Every indexed key's value with its common prefix with the query (`key`, its tokens `ids`), longest
        first."""
        keys, values, adjacent = self._keys, self._values, self._adjacent
        right = bisect_left(keys, key)
        left = right - 1
        c_right = common_prefix(ids, self._ids[right]) if right < len(keys) else -1
        c_left = common_prefix(ids, self._ids[left]) if left >= 0 else -1
        while c_left >= 0 or c_right >= 0:
            if c_right >= c_left:
                yield values[right], c_right
                right += 1
                c_right = min(c_right, adjacent[right - 1]) if right < len(keys) else -1
            else:
                yield values[left], c_left
                left -= 1
                c_left = min(c_left, adjacent[left]) if left >= 0 else -1
