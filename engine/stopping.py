"""Stopping: which of a request's tokens it emits, and when it ends (EOS, stop sequences, max tokens)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import FinishReason, GeneratedToken, StopCriteria


class _StopMatcher:
    """Withholds tokens that may be the start of a stop sequence until it is decided."""

    def __init__(self, sequences: Sequence[tuple[int, ...]]):
        self.sequences = [tuple(s) for s in sequences]
        self.pending: list[GeneratedToken] = []

    def push(self, tok: GeneratedToken) -> tuple[list[GeneratedToken], bool]:
        """Returns (tokens now safe to emit, whether a stop sequence completed)."""
        self.pending.append(tok)
        ids = tuple(t.token_id for t in self.pending)
        for seq in self.sequences:
            if len(ids) >= len(seq) and ids[-len(seq) :] == seq:
                safe = self.pending[: len(ids) - len(seq)]
                self.pending = []
                return safe, True
        keep = 0
        for seq in self.sequences:
            for n in range(min(len(seq) - 1, len(ids)), 0, -1):
                if ids[-n:] == seq[:n]:
                    keep = max(keep, n)
                    break
        safe = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return safe, False

    def flush(self) -> list[GeneratedToken]:
        out, self.pending = self.pending, []
        return out


class FinishTracker:
    """Decides, token by token, what a request emits and when it ends.

    `push` returns the tokens that may be emitted now; the last one carries the
    finish reason once the request is done. EOS and stop-sequence tokens come
    back flagged `is_stop`; tokens that may start a stop sequence are held back.
    """

    def __init__(self, stop: StopCriteria):
        self.stop = stop
        self.matcher = _StopMatcher(stop.stop_sequences)
        self.ids: list[int] = []  # every token pushed, withheld and stop tokens included
        self.done = False

    @property
    def generated(self) -> int:
        return len(self.ids)

    def push(self, tok: GeneratedToken) -> list[GeneratedToken]:
        assert not self.done, "push after the request finished"
        self.ids.append(tok.token_id)
        if not self.stop.ignore_eos and tok.token_id in self.stop.eos_ids:
            self.done = True
            return self.matcher.flush() + [tok.finished(FinishReason.STOP, is_stop=True)]
        safe, matched = self.matcher.push(tok)
        if matched:
            self.done = True
            return safe + [tok.finished(FinishReason.STOP, is_stop=True)]
        if self.generated >= self.stop.max_tokens:
            self.done = True
            rest = safe + self.matcher.flush()
            return rest[:-1] + [rest[-1].finished(FinishReason.LENGTH)]
        return safe
