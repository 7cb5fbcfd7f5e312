"""The JSON the server sends back: completion and chat bodies, stream chunks, usage, logprobs.

The usage object carries the OpenAI fields plus one extension, `engine`:

    "engine": {
      "lane": "continuous" | "serial" | "spec",  where the request ran
      "lane_reason": "...",                why it ran there
      "kernels": "exact" | "fast",         the kernel tier the model runs (the server's, all lanes)
      "batch_size": 3,                     most rows in the batch while it ran
      "finish": "stop" | "length" | ...,   the engine's finish reason
      "timings_ms": {"queue", "prefill", "first_token", "decode", "total"},
      "spec": {...},                       on the spec lane: SpecStats.as_dict()
      "ignored_fields": [...]              request fields accepted and ignored (engine.server.fields), if any
    }
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.request import GeneratedToken, RequestResult
from engine.server.tool_calls import CallDelta, ToolCall
from engine.server.worker import Stream

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class Delta:
    """What one engine event adds to a reply (`finish`: its finish reason, at the end)."""

    text: str
    tokens: list
    finish: str | None = None
    calls: tuple[CallDelta, ...] = ()  # what it streams of tool calls
    reasoning: str = ""


@dataclass
class Output:
    """What one request produced so far, gathered from its events."""

    request_id: str
    model: str
    is_chat: bool
    index: int = 0  # the choice's index: its prompt's place in the request
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    tokens: list[GeneratedToken] = field(default_factory=list)  # emitted, stop tokens excluded
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed out of the text (not in `text`)
    reasoning: str = ""  # a thinking template's reasoning (not in `text`)
    echo_text: str = ""  # completions with echo: the prompt, ahead of `text`
    echo_tokens: list[GeneratedToken] = field(default_factory=list)  # and its tokens (scored where asked)
    end_token: GeneratedToken | None = None  # the token that ended the output (EOS, a stop id), not in `tokens`

    @property
    def object(self) -> str:
        return "chat.completion" if self.is_chat else "text_completion"


def usage(
    result: RequestResult,
    cached_tokens: int,
    stream: Stream,
    lane_reason: str,
    kernels: str,
    ignored: Sequence[str] = (),
) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.generated_tokens,
        "total_tokens": result.prompt_tokens + result.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "engine": {
            "lane": result.lane.value,
            "lane_reason": lane_reason,
            "kernels": kernels,
            "batch_size": stream.max_batch,
            "finish": result.finish_reason.value,
            "timings_ms": stream.times.as_ms(),
            **({"spec": result.spec.as_dict()} if result.spec is not None else {}),
            **({"ignored_fields": list(ignored)} if ignored else {}),
        },
    }


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage so far, on every chunk of a stream that asked for it (vLLM's continuous_usage_stats)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def total_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One request's usage over its prompts: the counts summed, the first prompt's `engine` block."""
    if len(usages) == 1:
        return usages[0]
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}, "engine": usages[0]["engine"]}


def completion_logprobs(tokens: Sequence[GeneratedToken], text_of: TokenText) -> dict[str, Any]:
    """The legacy completions shape: parallel lists."""
    texts = [text_of(t.token_id) for t in tokens]
    offsets, at = [], 0
    for s in texts:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [
            None if t.logprob is None else {text_of(x.token_id): x.logprob for x in (t.top_logprobs or ())}
            for t in tokens
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokens: Sequence[GeneratedToken], text_of: TokenText) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = text_of(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(t.token_id, t.logprob),
                "top_logprobs": [entry(x.token_id, x.logprob) for x in (t.top_logprobs or ())],
            }
            for t in tokens
        ]
    }


def _logprobs(out: Output, tokens: Sequence[GeneratedToken], text_of: TokenText) -> dict[str, Any] | None:
    if all(t.logprob is None for t in tokens):  # none asked (an echoed prompt's first token has none either)
        return None
    return chat_logprobs(tokens, text_of) if out.is_chat else completion_logprobs(tokens, text_of)


def _choice(out: Output, text: str, tokens, finish: str | None, text_of: TokenText, ids: bool, delta=None):
    """A choice; for a chat stream chunk, `delta` is the message delta."""
    choice: dict[str, Any] = {"index": out.index}
    if not out.is_chat:
        choice["text"] = text
    elif delta is not None:
        choice["delta"] = delta
    else:
        # no content: null, where the reply is calls or reasoning only (OpenAI's)
        choice["message"] = {"role": "assistant", "content": text or (None if out.tool_calls or out.reasoning else "")}
        if out.reasoning:
            choice["message"]["reasoning_content"] = out.reasoning
        if out.tool_calls:
            choice["message"]["tool_calls"] = [c.as_message() for c in out.tool_calls]
    choice["logprobs"] = _logprobs(out, tokens, text_of)
    choice["finish_reason"] = finish
    if ids:
        choice["token_ids"] = [t.token_id for t in tokens]
    return choice


def body(
    outs: Sequence[tuple[Output, str | None]], usage_obj: dict[str, Any], text_of: TokenText, ids: bool
) -> dict[str, Any]:
    """The whole non-streaming response: a choice per (output, finish reason), an echoed prompt ahead of its
    text and logprobs."""
    choices = []
    for out, finish in outs:
        choice = _choice(out, out.echo_text + out.text, out.tokens, finish, text_of, ids)
        if out.echo_tokens:  # every token through the model: the prompt's, then each generated, the ending one too
            ended = [out.end_token] if out.end_token is not None else []
            choice["logprobs"] = _logprobs(out, out.echo_tokens + out.tokens + ended, text_of)
        choices.append(choice)
    first = outs[0][0]
    return {
        "id": first.request_id,
        "object": first.object,
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "usage": usage_obj,
    }


def chunk(
    out: Output,
    text: str,
    tokens: Sequence[GeneratedToken],
    finish: str | None,
    text_of: TokenText,
    ids: bool,
    role: bool = False,
    reasoning: str = "",
) -> dict[str, Any]:
    """One stream chunk; `role` marks a chat stream's opening chunk; `reasoning`: reasoning text in it."""
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
    if reasoning:
        delta["reasoning_content"] = reasoning
    return {
        "id": out.request_id,
        "object": "chat.completion.chunk" if out.is_chat else "text_completion",
        "created": out.created,
        "model": out.model,
        "choices": [_choice(out, text, tokens, finish, text_of, ids, delta=delta)],
    }


def call_chunks(
    out: Output, deltas: Sequence[CallDelta], text_of: TokenText, ids: bool, tokens: Sequence[GeneratedToken] = ()
) -> list[dict[str, Any]]:
    """The stream chunks of tool calls, as OpenAI streams a call: a delta with its index, id, type and name
    (arguments ''), then deltas with fragments of its arguments; `tokens` (their logprobs, ids) go with the
    first."""
    chunks = []
    for i, delta in enumerate(deltas):
        piece = chunk(out, "", tokens if i == 0 else [], None, text_of, ids)
        piece["choices"][0]["delta"] = {"tool_calls": [delta.as_entry()]}
        chunks.append(piece)
    return chunks


def usage_chunk(out: Output, usage_obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": out.request_id,
        "object": "chat.completion.chunk" if out.is_chat else "text_completion",
        "created": out.created,
        "model": out.model,
        "choices": [],
        "usage": usage_obj,
    }
