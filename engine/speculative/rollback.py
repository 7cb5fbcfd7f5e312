"""Undoing the tokens a speculation round fed but did not keep.

Attention caches rewind by trimming. Recurrent (Gated DeltaNet) state cannot
be trimmed; a round keeps a checkpoint of it (the arrays as they were, which
MLX never mutates, so this copies nothing) and rewinds it one of two ways:

    trace   the round's forwards recorded the state after every token they
            fed (`RecurrentCache.start_trace`); keep the one after the last
            kept token. No extra forward: the default.
    replay  restore the checkpoint, trim the other layers back to the same
            point and feed the kept tokens again in one forward. Needs
            nothing from the layer, so it is the fallback for layers that
            record no trace; it costs a target forward per rejection.

Rotating (sliding-window) caches can be trimmed only until they wrap, so a
round never feeds past the window (`room`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import mlx.core as mx
import mlx.nn as nn

from engine.cache import RecurrentCache, RotatingKVCache


class Rollback(str, Enum):
    """How recurrent layers undo rejected drafts; equal to its string, and printed as it."""

    TRACE = "trace"  # record each fed token's state, take the last accepted one
    REPLAY = "replay"  # restore the round's start, then feed the accepted tokens again

    def __str__(self) -> str:
        return self.value


ROLLBACKS = tuple(r.value for r in Rollback)


@dataclass(frozen=True)
class Checkpoint:
    offsets: tuple[int, ...]
    slots: tuple[list | None, ...]  # recurrent layers' arrays; None for trimmable layers


def checkpoint(cache: list, trace: bool = True) -> Checkpoint:
    """Before a round feeds tokens: remember the recurrent state (and, with `trace`, start recording)."""
    slots = []
    for c in cache:
        if isinstance(c, RecurrentCache):
            slots.append(c.snapshot())
            if trace:
                c.start_trace()
        else:
            slots.append(None)
    return Checkpoint(tuple(c.offset for c in cache), tuple(slots))


def rewind(model: nn.Module, cache: list, point: Checkpoint, fed: Sequence[int], keep: int) -> bool:
    """The cache went from `point` through the tokens `fed`; make it hold only `fed[:keep]`.

    Returns True when it took a replay forward.
    """
    drop = len(fed) - keep
    recurrent = [c for c, s in zip(cache, point.slots) if s is not None]
    traced = all(c.trace is not None and len(c.trace.states) == len(fed) for c in recurrent)
    if drop <= 0 or not recurrent or (traced and keep > 0):
        for c in cache:
            if isinstance(c, RecurrentCache):
                if drop > 0:
                    c.keep_traced(keep)
                c.trace = None
            else:
                c.trim(drop)
        return False
    for c, offset, slots in zip(cache, point.offsets, point.slots):
        if slots is None:
            c.trim(c.offset - offset)
        else:
            c.trace = None
            c.restore(slots, offset)
    if keep:
        model.hidden(mx.array(list(fed[:keep]))[None], cache)
    return keep > 0


def room(cache: list) -> int | None:
    """Tokens the cache can take before a sliding-window layer wraps (None: no limit)."""
    rooms = [c.max_size - c.offset for c in cache if isinstance(c, RotatingKVCache)]
    return min(rooms) if rooms else None
