"""Undoing the tokens a speculation round fed but did not keep.

Attention caches rewind by trimming. Recurrent (Gated DeltaNet) state cannot
be trimmed: a round keeps a checkpoint of it (the arrays as they were, which
MLX never mutates, so this copies nothing) and, after a rejection, restores
it, trims the other layers back to the same point and replays the kept
tokens in one forward. Rotating (sliding-window) caches can be trimmed only
until they wrap, so a round never feeds past the window (`room`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.cache import RotatingKVCache


@dataclass(frozen=True)
class Checkpoint:
    offsets: tuple[int, ...]
    slots: tuple[Optional[list], ...]  # recurrent slots; None for trimmable layers


def checkpoint(cache: list) -> Checkpoint:
    return Checkpoint(
        tuple(c.offset for c in cache),
        tuple(None if c.is_trimmable() else c.snapshot() for c in cache),
    )


def rewind(model: nn.Module, cache: list, point: Checkpoint, fed: Sequence[int], keep: int) -> bool:
    """The cache went from `point` through the tokens `fed`; make it hold only `fed[:keep]`.

    Returns True when it took a replay forward (some layer cannot be trimmed).
    """
    drop = len(fed) - keep
    if drop <= 0:
        return False
    if all(s is None for s in point.slots):
        for c in cache:
            c.trim(drop)
        return False
    for c, offset, slots in zip(cache, point.offsets, point.slots):
        if slots is None:
            c.trim(c.offset - offset)
        else:
            c.restore(slots, offset)
    if keep:
        model.hidden(mx.array(list(fed[:keep]))[None], cache)
    return True


def room(cache: list) -> Optional[int]:
    """Tokens the cache can take before a sliding-window layer wraps (None: no limit)."""
    rooms = [c.max_size - c.offset for c in cache if isinstance(c, RotatingKVCache)]
    return min(rooms) if rooms else None
