"""Stop strings matched on the output text, as OpenAI defines `stop`.

The engine also stops on the token ids of each stop string (cheap, and exact
when the output tokenizes the same way), but a stop string can appear across
a different tokenization; the text is the contract. Text that might be the
start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `tag`: what to hold back while the text
    may still become `tag` (a stop string, a tool-call or reasoning tag)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class TextStopper:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add output text; return what may be shown. After a match, `stopped` is set and nothing more is shown."""
        if self.stopped:
            return ""
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.held = self.held[: min(hits)], ""
            return out
        keep = max((partial_suffix(self.held, s) for s in self.stops), default=0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
