"""Tool calls in generated text: the `<tool_call>` JSON blocks of Qwen's (Hermes-style) chat templates.

A model served with `tools` writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` takes the text as it streams and splits it into content and
calls: text outside the blocks is content (held back only while it could be
the start of `<tool_call>`), a complete block whose JSON names a function is a
call, and a block that does not parse (or never closes) stays content, as
written. The format is chosen from the chat template (`parser_for`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call: an id for the tool's answer to name, the function, its arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def as_message(self, index: Optional[int] = None) -> dict:
        """The OpenAI `tool_calls` entry (with `index` for a stream's delta)."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


@dataclass(frozen=True)
class Parsed:
    """What a piece of text gave: content to pass on, calls completed in it."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()


def _call(block: str) -> Optional[ToolCall]:
    """A block's call, or None where its JSON is not {"name": str, "arguments": object or str}."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(f"call_{secrets.token_hex(12)}", obj["name"], text)


@dataclass
class ToolCallParser:
    """Streaming split of generated text into content and tool calls."""

    _pending: str = ""  # content that may be the start of OPEN, or a block not yet closed
    _inside: bool = False
    calls: list[ToolCall] = field(default_factory=list)  # every call so far

    def push(self, text: str) -> Parsed:
        self._pending += text
        content, calls = [], []
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                block, self._pending = self._pending[:end], self._pending[end + len(CLOSE) :]
                self._inside = False
                call = _call(block)
                if call is None:  # not a call after all: the block stays text, as written
                    content.append(OPEN + block + CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                content.append(self._pending[:start])
                self._pending = self._pending[start + len(OPEN) :]
                self._inside = True
                continue
            keep = _partial_open(self._pending)  # hold back a tail that may become OPEN
            content.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        self.calls += calls
        return Parsed("".join(content), tuple(calls))

    def flush(self) -> Parsed:
        """The end of the text: what is held back is content (an unclosed block as written)."""
        rest = (OPEN if self._inside else "") + self._pending
        self._pending, self._inside = "", False
        return Parsed(rest)


def _partial_open(text: str) -> int:
    """How many trailing characters of `text` are a proper prefix of OPEN."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parser_for(chat_template: Optional[str]) -> Optional[type[ToolCallParser]]:
    """The tool-call format a chat template writes (None: it renders no tools)."""
    return ToolCallParser if chat_template and OPEN in chat_template else None


def split(text: str) -> Parsed:
    """A whole text's content and calls."""
    parser = ToolCallParser()
    first, last = parser.push(text), parser.flush()
    return Parsed(first.content + last.content, first.calls)
