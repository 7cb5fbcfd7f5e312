"""Reasoning text in a reply: the `<think>...</think>` block of templates that think (Qwen3, Qwen3.5).

The block's text goes to `reasoning_content`, the rest to `content`. A template whose generation prompt
opens the block itself (thinking on) starts the reply inside it (`ReasoningParser(inside=True)`);
otherwise a reply that opens with `<think>` (after whitespace) enters it. Text is held back only while
it may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.server.stop_text import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Streaming split of a reply into reasoning and content."""

    def __init__(self, inside: bool = False):
        self._state = "inside" if inside else "start"  # start: may still open a block; inside; closed; after
        self._pending = ""

    def push(self, text: str) -> Split:
        self._pending += text
        reasoning = content = ""
        if self._state == "start":
            head = self._pending.lstrip()
            if head.startswith(OPEN):
                self._pending, self._state = head[len(OPEN) :], "inside"
            elif OPEN.startswith(head):  # whitespace or a partial tag so far: wait
                return Split()
            else:
                self._state = "after"
        if self._state == "inside":
            end = self._pending.find(CLOSE)
            if end < 0:
                keep = partial_suffix(self._pending, CLOSE)
                reasoning, self._pending = (
                    self._pending[: len(self._pending) - keep],
                    self._pending[len(self._pending) - keep :],
                )
                return Split(reasoning)
            reasoning, self._pending = self._pending[:end], self._pending[end + len(CLOSE) :]
            self._state = "closed"
        if self._state == "closed":  # the newlines a template puts after the block belong to neither
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return Split(reasoning)
            self._state = "after"
        content, self._pending = self._pending, ""
        return Split(reasoning, content)

    def flush(self) -> Split:
        """The end of the reply: what is held back goes where it would have."""
        rest, self._pending = self._pending, ""
        return Split(rest) if self._state == "inside" else Split(content=rest)


def thinks(chat_template: str | None) -> bool:
    """Whether a chat template writes reasoning blocks."""
    return bool(chat_template) and OPEN in chat_template


def opened(prompt_tail: str) -> bool:
    """Whether the prompt (its last tokens' text) opened the block: the reply then starts inside it."""
    return prompt_tail.rstrip().endswith(OPEN)
