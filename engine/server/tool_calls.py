"""Tool calls in generated text, in the formats of the registry's chat templates.

- Qwen's (Hermes-style) JSON blocks:
  `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`;
- Qwen's XML blocks (Qwen3-Coder, Qwen3.5):
  `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`;
- Llama 3's JSON reply: the whole reply `{"name": "get_weather", "parameters": {"city": "Paris"}}`
  (after an optional `<|python_tag|>`).

`ToolCallParser` takes the text as it streams and splits it into content and
calls, as OpenAI streams them: text outside the blocks is content (held back
only while it could be the start of `<tool_call>`); a block that opens as a
call gives the call's id and name as soon as the name is read, then its
arguments in fragments as they are written (`CallDelta`s; a call's fragments
join to its arguments). A block of another shape is read whole at its close:
a call if it parses as one, else content as written. A block that never
closes (a reply cut off by max_tokens) is never content: a call already named
keeps the arguments written so far, as OpenAI returns a truncated call (with
finish_reason length); anything else is dropped, as is a start of
`<tool_call>` at the very end. `LlamaJsonParser` holds a
reply that opens like a call until its end. The format is chosen from the
chat template (`parser_for`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from engine.server.stop_text import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call: an id for the tool's answer to name, the function, its arguments as a JSON string."""

    id: str
    name: str
    arguments: str

    def as_message(self) -> dict:
        """The OpenAI `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallDelta:
    """A piece of a call as it streams: its head (id and name, no arguments) once the name is read, then
    fragments of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_entry(self) -> dict:
        """The `delta.tool_calls` entry OpenAI streams."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


def _heads(call: ToolCall, index: int) -> tuple[CallDelta, ...]:
    """A call read whole, as a stream gives it: the head, then the arguments."""
    return (CallDelta(index, id=call.id, name=call.name),) + _fragment(index, call.arguments)


def _fragment(index: int, arguments: str) -> tuple[CallDelta, ...]:
    return (CallDelta(index, arguments),) if arguments else ()


@dataclass(frozen=True)
class Parsed:
    """What a piece of text gave: content to pass on, calls that ended in it (closed, or cut off at the end),
    and what to stream of calls (heads and argument fragments, those of one call joined)."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()
    deltas: tuple[CallDelta, ...] = ()

    def __add__(self, other: Parsed) -> Parsed:
        deltas: list[CallDelta] = []
        for d in self.deltas + other.deltas:
            if deltas and d.name is None and deltas[-1].name is None and deltas[-1].index == d.index:
                d = CallDelta(d.index, deltas.pop().arguments + d.arguments)
            deltas.append(d)
        return Parsed(self.content + other.content, self.calls + other.calls, tuple(deltas))


def _new_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(block: str) -> ToolCall | None:
    """A JSON block's call, or None where it is not {"name": str, "arguments" (or "parameters"): object or JSON
    text}."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    return _json_call(obj)


def _json_call(obj) -> ToolCall | None:
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


def _value(text: str) -> Any:
    """An XML parameter's value: what it reads as in JSON where that is not a string (a number, true, a list),
    else the text."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(parsed, str) else parsed


def _xml_call(block: str) -> ToolCall | None:
    """An XML block's call (`<function=NAME>` holding `<parameter=KEY>value</parameter>`s), or None."""
    match = _FUNCTION.fullmatch(block)
    if match is None:
        return None
    name, body = match.groups()
    args = {key: _value(value) for key, value in _PARAMETER.findall(body)}
    if _PARAMETER.sub("", body).strip():  # text outside the parameters: not a call as the format writes it
        return None
    return ToolCall(_new_id(), name, json.dumps(args, ensure_ascii=False))


class _Block:
    """One block after OPEN, as it streams. A format reads the head (`name` once known) and the arguments
    (`_read` returns each new fragment; `stop` once they end), or gives up on streaming it (`whole`: read at
    its close by `parse`). CLOSE is looked for only after the arguments or in a whole block, so that it may
    stand inside an argument's text."""

    parse: Callable[[str], ToolCall | None]

    def __init__(self):
        self.text = ""  # the block so far (and whatever followed it in the same piece)
        self.name: str | None = None
        self.whole = False
        self.arguments = ""  # the fragments so far
        self.stop: int | None = None  # where the arguments ended in `text`
        self.close: int | None = None  # where CLOSE starts in `text`
        self._searched = 0

    def feed(self, more: str) -> str:
        """Take more text; the new fragment of the arguments."""
        self.text += more
        fragment = self._read()
        self.arguments += fragment
        if self.close is None and (self.whole or self.stop is not None):
            at = self.text.find(CLOSE, max(self.stop or 0, self._searched - len(CLOSE) + 1))
            self._searched = len(self.text)
            self.close = at if at >= 0 else None
        return fragment

    def _read(self) -> str:
        raise NotImplementedError

    @property
    def body(self) -> str:
        return self.text if self.close is None else self.text[: self.close]

    @property
    def rest(self) -> str:
        """The text after CLOSE."""
        assert self.close is not None
        return self.text[self.close + len(CLOSE) :]

    def cut(self) -> str:
        """The last fragment where the text ends inside the arguments."""
        return ""


_NAME = re.compile(r'"([^"\\<\n]*)"')  # a function name in a JSON head: no escapes, no markup
_JSON_HEAD = ("{", '"name"', ":", "NAME", ",", '"arguments"|"parameters"', ":", "{")


def _json_head(text: str) -> tuple[bool | None, str, int]:
    """Whether `text` opens as `{"name": "NAME", "arguments": {` (or "parameters"), whitespace anywhere
    between: (True, the name, where its arguments' `{` stands), (None, ...) while it may still, (False, ...)
    when it does not."""
    at, name = 0, ""
    for part in _JSON_HEAD:
        at += len(text[at:]) - len(text[at:].lstrip())
        rest = text[at:]
        if not rest:
            return None, "", 0
        if part == "NAME":
            match = _NAME.match(rest)
            if match is None:
                return (None if re.fullmatch(r'"[^"\\<\n]*', rest) else False), "", 0
            name, at = match[1], at + match.end()
            continue
        options = part.split("|")
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return (None if any(o.startswith(rest) for o in options) else False), "", 0
        at += len(hit)
    return bool(name), name, at - 1  # the arguments' `{`


class _JsonBlock(_Block):
    """`{"name": ..., "arguments": {...}}`: the arguments stream as written, up to their closing brace (a
    character no JSON holds outside a string, such as `<`, ends them too)."""

    parse = staticmethod(_call)

    def __init__(self):
        super().__init__()
        self._at, self._depth, self._quoted, self._escaped = 0, 0, False, False

    def _read(self) -> str:
        if self.name is None and not self.whole:
            found, name, start = _json_head(self.text)
            if found:
                self.name, self._at = name, start
            self.whole = found is False
        if self.name is None or self.stop is not None:
            return ""
        begin = self._at
        self._scan()
        return self.text[begin : self._at]

    def _scan(self) -> None:
        text, i = self.text, self._at
        while i < len(text):
            ch = text[i]
            if self._quoted:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._quoted = False
            elif ch == '"':
                self._quoted = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    i += 1
                    self.stop = i
                    break
            elif ch == "<":
                self.stop = i
                break
            i += 1
        self._at = i


_XML_HEAD = re.compile(r"\s*<function=([^>\s]+)>")
_XML_OPENING = re.compile(r"\s*(<function=[^>\s]*)?")
_XML_TAGS = ("<parameter=", "</function>", CLOSE)


class _XmlBlock(_Block):
    """`<function=NAME>` and its `<parameter=KEY>`s: each parameter streams as one fragment of the JSON object
    the arguments are (`{"KEY": value`, `, "KEY": value`, ..., `}`), once its `</parameter>` is read."""

    parse = staticmethod(_xml_call)

    def __init__(self):
        super().__init__()
        self._at, self._count = 0, 0
        self._param_from = 0  # where to look on for the open parameter's end

    def _read(self) -> str:
        if self.name is None and not self.whole:
            self._head()
        if self.name is None or self.stop is not None:
            return ""
        return ("" if self.arguments else "{") + self._parameters()

    def _head(self) -> None:
        """The name, once `<function=NAME>` is followed by a tag (text there instead: not streamed)."""
        match = _XML_HEAD.match(self.text)
        if match is None:
            opening = self.text.lstrip()
            self.whole = not ("<function=".startswith(opening) or _XML_OPENING.fullmatch(self.text))
            return
        after = self.text[match.end() :].lstrip()
        if after.startswith(_XML_TAGS[:2]):
            self.name, self._at = match[1], match.end()
        elif not any(tag.startswith(after) for tag in _XML_TAGS[:2]):
            self.whole = True

    def _parameters(self) -> str:
        out = []
        while True:
            body = self.text[self._at :].lstrip()
            at = len(self.text) - len(body)
            if body.startswith("<parameter="):
                end = self.text.find("</parameter>", max(at, self._param_from))
                if end < 0:
                    self._param_from = len(self.text) - len("</parameter>") + 1
                    break
                self._at = end + len("</parameter>")
                match = _PARAMETER.fullmatch(self.text, at, self._at)
                if match is not None:
                    out.append(
                        (", " if self._count else "")
                        + json.dumps(match[1], ensure_ascii=False)
                        + ": "
                        + json.dumps(_value(match[2]), ensure_ascii=False)
                    )
                    self._count += 1
            elif body.startswith(_XML_TAGS[1:]):
                out.append("}")
                self.stop = at + (len("</function>") if body.startswith("</function>") else 0)
                break
            elif any(tag.startswith(body) for tag in _XML_TAGS):
                break  # nothing yet, or a tag being written
            else:  # loose text between parameters: passed over
                nxt = self.text.find("<", at + 1)
                self._at = nxt if nxt >= 0 else len(self.text)
        return "".join(out)

    def cut(self) -> str:
        return "}" if self.stop is None else ""  # the parameters read so far, as a whole object


@dataclass
class ToolCallParser:
    """Streaming split of generated text into content and `<tool_call>` blocks' calls (`block`: the template's
    format of a block)."""

    block: Callable[[], _Block] = _JsonBlock
    _pending: str = ""  # content that may be the start of OPEN
    _open: _Block | None = None  # the block being read
    _id: str = ""  # its call's id
    calls: list[ToolCall] = field(default_factory=list)  # every call so far

    def push(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while True:
            if self._open is not None:
                text, self._pending = self._pending, ""
                out += self._feed(text)
                if self._open.close is None:
                    return out
                self._pending = self._open.rest
                out += self._end(closed=True)
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                out += Parsed(self._pending[:start])
                self._pending = self._pending[start + len(OPEN) :]
                self._open, self._id = self.block(), _new_id()
                continue
            keep = partial_suffix(self._pending, OPEN)  # hold back a tail that may become OPEN
            out += Parsed(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return out

    def _feed(self, text: str) -> Parsed:
        block, index = self._open, len(self.calls)
        named = block.name is not None
        fragment = block.feed(text)
        head = (CallDelta(index, id=self._id, name=block.name),) if block.name is not None and not named else ()
        return Parsed(deltas=head + _fragment(index, fragment))

    def _end(self, closed: bool) -> Parsed:
        """The open block's end: its call, or its text where it is none (dropped where it never closed)."""
        block, self._open, index = self._open, None, len(self.calls)
        if block.name is not None:  # streamed: the call is what was streamed
            tail = "" if closed else block.cut()
            call, deltas = ToolCall(self._id, block.name, block.arguments + tail), _fragment(index, tail)
        else:
            call = block.parse(block.body)
            if call is None:
                return Parsed(OPEN + block.body + CLOSE if closed else "")
            deltas = _heads(call, index)
        self.calls.append(call)
        return Parsed(calls=(call,), deltas=deltas)

    def flush(self) -> Parsed:
        """The end of the text: an open block ends here; a tail held back as the start of OPEN is dropped (a
        call cut off as it opened)."""
        self._pending = ""
        return self._end(closed=False) if self._open is not None else Parsed()


PYTHON_TAG = "<|python_tag|>"


@dataclass
class LlamaJsonParser:
    """Llama 3's format: a reply that is one JSON call. A reply that opens with `{` (or the python tag) is held
    until its end and is a call if it parses as one; any other streams as content."""

    _pending: str = ""
    _holding: bool | None = None  # None: not known yet (only whitespace so far)
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
                return Parsed(calls=(call,), deltas=_heads(call, 0))
        return Parsed(text)


Parser = Callable[[], "ToolCallParser | LlamaJsonParser"]


def parser_for(chat_template: str | None) -> Parser | None:
    """A parser factory for the tool-call format a chat template writes (None: it renders no tools)."""
    if not chat_template:
        return None
    if OPEN in chat_template:
        return partial(ToolCallParser, _XmlBlock) if "<function=" in chat_template else ToolCallParser
    if PYTHON_TAG in chat_template or '"parameters": dictionary' in chat_template:
        return LlamaJsonParser
    return None


def writes_json_blocks(parser: Parser | None) -> bool:
    """Whether a format is the JSON blocks a forced call's grammar writes (`engine.grammar.Grammars.tool_calls`)."""
    return parser is ToolCallParser


def split(text: str, parser: Parser | None = None) -> Parsed:
    """A whole text's content and calls (in the JSON block format unless another parser factory is given)."""
    p = (parser or ToolCallParser)()
    return p.push(text) + p.flush()
