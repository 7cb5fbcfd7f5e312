"""Streaming detokenization: text deltas that never split a multi-byte character.

Decoding token by token breaks characters that span tokens (byte-level BPE),
and decoding the whole output each time costs O(n^2). As vLLM does, decode a
short window: the text of the tokens since `prefix` is compared with the text
up to `read`; the difference is emitted once it no longer ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class StreamingDetokenizer:
    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text was emitted
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The rest, incomplete characters included (at the end of the output)."""
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        delta = after[len(before) :] if after.startswith(before) else ""
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
