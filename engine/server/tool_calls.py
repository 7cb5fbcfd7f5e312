"""Tool calls in generated text, in the formats of the registry's chat templates.

- Qwen's (Hermes-style) JSON blocks:
  `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`;
- Qwen's XML blocks (Qwen3-Coder, Qwen3.5):
  `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`;
- Llama 3's JSON reply: the whole reply `{"name": "get_weather", "parameters": {"city": "Paris"}}`
  (after an optional `<|python_tag|>`).

`ToolCallParser` takes the text as it streams and splits it into content and
calls: text outside the blocks is content (held back only while it could be
the start of `<tool_call>`), a complete block that names a function is a call,
and a block that does not parse (or never closes) stays content, as written.
`LlamaJsonParser` holds a reply that opens like a call until its end. The
format is chosen from the chat template (`parser_for`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

from engine.server.stop_text import partial_suffix

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


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(block: str) -> Optional[ToolCall]:
    """A JSON block's call, or None where it is not {"name": str, "arguments" (or "parameters"): object or JSON
    text}."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    return _json_call(obj)


def _json_call(obj) -> Optional[ToolCall]:
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
    return ToolCall(_new_id(), obj["name"], text)


_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_call(block: str) -> Optional[ToolCall]:
    """An XML block's call (`<function=NAME>` holding `<parameter=KEY>value</parameter>`s), or None. A value
    that reads as JSON other than a string (a number, true, a list) is that value; any other is the text."""
    match = _FUNCTION.fullmatch(block)
    if match is None:
        return None
    name, body = match.groups()
    args = {}
    for key, value in _PARAMETER.findall(body):
        try:
            parsed = json.loads(value)
            args[key] = value if isinstance(parsed, str) else parsed
        except json.JSONDecodeError:
            args[key] = value
    if _PARAMETER.sub("", body).strip():  # text outside the parameters: not a call as the format writes it
        return None
    return ToolCall(_new_id(), name, json.dumps(args, ensure_ascii=False))


@dataclass
class ToolCallParser:
    """Streaming split of generated text into content and `<tool_call>` blocks' calls (`block`: a block's call
    in the template's format)."""

    block: Callable[[str], Optional[ToolCall]] = _call
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
                call = self.block(block)
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
            keep = partial_suffix(self._pending, OPEN)  # hold back a tail that may become OPEN
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


PYTHON_TAG = "<|python_tag|>"


@dataclass
class LlamaJsonParser:
    """Llama 3's format: a reply that is one JSON call. A reply that opens with `{` (or the python tag) is held
    until its end and is a call if it parses as one; any other streams as content."""

    _pending: str = ""
    _holding: Optional[bool] = None  # None: not known yet (only whitespace so far)
    calls: list[ToolCall] = field(default_factory=list)

    def push(self, text: str) -> Parsed:
        self._pending += text
        if self._holding is None:
            head = self._pending.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return Parsed()
            self._holding = head.startswith("{") or head.startswith(PYTHON_TAG)
        if self._holding:
            return Parsed()
        out, self._pending = self._pending, ""
        return Parsed(out)

    def flush(self) -> Parsed:
        text, self._pending = self._pending, ""
        if self._holding:
            body = text.strip().removeprefix(PYTHON_TAG).strip()
            try:
                call = _json_call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                self.calls.append(call)
                return Parsed(calls=(call,))
        return Parsed(text)


Parser = Callable[[], "ToolCallParser | LlamaJsonParser"]


def parser_for(chat_template: Optional[str]) -> Optional[Parser]:
    """A parser factory for the tool-call format a chat template writes (None: it renders no tools)."""
    if not chat_template:
        return None
    if OPEN in chat_template:
        return partial(ToolCallParser, _xml_call) if "<function=" in chat_template else ToolCallParser
    if PYTHON_TAG in chat_template or '"parameters": dictionary' in chat_template:
        return LlamaJsonParser
    return None


def writes_json_blocks(parser: Optional[Parser]) -> bool:
    """Whether a format is the JSON blocks a forced call's grammar writes (`engine.grammar.Grammars.tool_calls`)."""
    return parser is ToolCallParser


def split(text: str, parser: Optional[Parser] = None) -> Parsed:
    """A whole text's content and calls (in the JSON block format unless another parser factory is given)."""
    p = (parser or ToolCallParser)()
    first, last = p.push(text), p.flush()
    return Parsed(first.content + last.content, first.calls + last.calls)
