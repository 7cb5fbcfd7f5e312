"""The draft-source protocol: what the verifier asks of anything that proposes tokens.

A source sees the prompt once (`begin`, and for sources that read the
target's hidden states, `observe` for every prefill chunk), proposes up to
`limit` tokens that may follow the pending token (`propose`; zero tokens is
a valid answer), and learns the outcome of each round (`commit`). The
verifier owns the target and its caches; a source owns only its own state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx


@dataclass(frozen=True)
class Round:
    """One verified round, as the source needs it to commit.

    The target fed `fed` = [pending, drafts...] and kept `fed[:accepted + 1]`;
    `next_token` is its own token after them (the correction or the bonus).
    `hidden` is the target's final hidden state over `fed` ([1, len(fed), H]).
    """

    fed: tuple[int, ...]
    accepted: int
    next_token: int
    hidden: mx.array

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.fed[1:]


class DraftSource(Protocol):
    kind: str

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new request: its prompt (the target prefills all but the last token)."""

    def observe(self, hidden: mx.array, start: int) -> None:
        """The target's hidden state [1, n, H] for prompt positions start .. start + n - 1."""

    def propose(self, pending: int, limit: int) -> list[int]:
        """Up to `limit` tokens to follow `pending` (the last emitted token, not yet fed)."""

    def commit(self, result: Round) -> None:
        """The round's outcome; rewind whatever the rejected drafts touched."""
