"""The OpenAI request bodies the server accepts, parsed into typed requests (no model, no arrays).

Every field is checked for type and range here; anything wrong becomes an
`ApiError` whose message names the field. Which fields are honoured, accepted
and ignored, or refused: `engine.server.fields`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine.request import SamplingParams
from engine.server import fields
from engine.server.strict_schema import strict_schema


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending parameter, code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # sent with the error (Retry-After on a 503)

    @property
    def kind(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 503: "overloaded_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


COMPLETION_FIELDS, CHAT_FIELDS = fields.COMPLETION, fields.CHAT
MAX_PROMPTS = 256  # prompts in one completions request


@dataclass(frozen=True)
class ParsedRequest:
    """One completion or chat request, checked; the prompt is not yet tokenized."""

    is_chat: bool
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]  # completions: each prompt, text or token ids (a choice each)
    messages: list[dict[str, Any]] | None  # chat, as the chat template takes them
    max_tokens: int | None  # None: the server's default, within the context; 0 (echo only): none generated
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM)
    echo: bool = False  # completions: the prompt leads the text (and its logprobs the logprobs)
    stop_token_ids: tuple[int, ...] = ()  # vLLM: more tokens that end the output, as EOS does
    min_tokens: int = 0  # vLLM: no end-of-sequence token before this many tokens
    ignored: tuple[str, ...] = ()  # fields accepted and ignored (`fields.IGNORED`), named in usage.engine
    tools: list[dict[str, Any]] | None = None  # chat: the functions the model may call (rendered, parsed)
    forced_tools: list[dict[str, Any]] | None = None  # tool_choice required (all) or named (one): a call must come
    several_calls: bool = False  # parallel_tool_calls true, no named choice: a constrained reply may hold more calls
    json_schema: dict[str, Any] | None = None  # response_format json_object / json_schema: the reply's schema
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs: more variables for the chat template


MAX_SEED = 2**64 - 1  # what the random key takes: an unsigned 64-bit integer


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose strings are all valid Unicode; 400 for anything else (nesting too deep
    for the parser, integers past Python's 4300-digit limit, lone surrogates such as "\\ud800")."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # e.g. an integer literal past sys.get_int_max_str_digits()
        raise bad(f"the request body holds a value this server cannot read: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    _check_strings(body)
    return body


def _check_strings(body: dict) -> None:
    """400 for a string (key or value, at any depth) that is not valid Unicode: a lone UTF-16 surrogate
    escaped in JSON decodes to a Python str that no tokenizer or encoder can take."""
    todo: list[tuple[str, Any]] = [(k, v) for k, v in body.items()]
    while todo:
        where, value = todo.pop()
        texts = [where] + ([value] if isinstance(value, str) else [])
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                field = where.split("[")[0].split(".")[0]
                raise bad(
                    f"'{where}' holds a lone surrogate (not valid Unicode text)", param=field, code="invalid_text"
                ) from None
        if isinstance(value, dict):
            todo.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


# ------------------------------------------------------------------ fields


def _typed(body: dict, name: str, kinds: tuple, what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; JSON true is not a number.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def _number(body: dict, name: str, default: float | None = None) -> float | None:
    value = _typed(body, name, (int, float), "a number", default)
    if value is not None and not math.isfinite(value):
        raise bad(f"'{name}' must be finite", param=name)
    return None if value is None else float(value)


def _int(body: dict, name: str, default: int | None = None) -> int | None:
    return _typed(body, name, (int,), "an integer", default)


def _flag(body: dict, name: str) -> bool:
    return _typed(body, name, (bool,), "true or false", False)


def _in_range(name: str, value, lo, hi, text: str) -> None:
    if value is not None and not lo <= value <= hi:
        raise bad(f"'{name}' must be {text}, got {value}", param=name)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise bad("'stop' must be a non-empty string or a list of at most 8 non-empty strings", param="stop")
    return tuple(stop)


def _logit_bias(body: dict) -> dict[int, float]:
    raw = _typed(body, "logit_bias", (dict,), "an object of token id -> bias", {})
    out = {}
    for key, value in raw.items():
        try:
            tid = int(key)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", param="logit_bias")
        out[tid] = float(value)
    return out


def _reject_unknown(body: dict, known: frozenset[str]) -> None:
    unknown = fields.unknown_fields(body, known)
    if unknown:
        raise bad(f"unknown field(s): {', '.join(unknown)}", param=unknown[0], code="unknown_field")


def _refuse_unsupported(body: dict) -> None:
    if _int(body, "n", 1) != 1:
        raise bad("only n=1 is supported", param="n")
    if _int(body, "best_of", 1) != 1:
        raise bad("only best_of=1 is supported", param="best_of")
    if body.get("suffix") is not None:
        raise bad("suffix is not supported", param="suffix")


def _sampling(body: dict, top_logprobs: int, want_logprobs: bool) -> SamplingParams:
    temperature = _number(body, "temperature", 0.0)  # greedy unless asked, as mlx_lm.server
    _in_range("temperature", temperature, 0, 2, "in [0, 2]")
    top_p = _number(body, "top_p", 1.0)
    _in_range("top_p", top_p, 1e-9, 1, "in (0, 1]")
    top_k = _int(body, "top_k", 0)
    _in_range("top_k", top_k, 0, 1 << 30, ">= 0")
    min_p = _number(body, "min_p", 0.0)
    _in_range("min_p", min_p, 0, 1, "in [0, 1]")
    rep = _number(body, "repetition_penalty")
    _in_range("repetition_penalty", rep, 1e-9, 10, "in (0, 10]")
    presence = _number(body, "presence_penalty")
    _in_range("presence_penalty", presence, -2, 2, "in [-2, 2]")
    frequency = _number(body, "frequency_penalty")
    _in_range("frequency_penalty", frequency, -2, 2, "in [-2, 2]")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        presence_penalty=presence or None,
        frequency_penalty=frequency or None,
        logit_bias=_logit_bias(body),
        seed=_seed(body),
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
    )


def _seed(body: dict) -> int | None:
    seed = _int(body, "seed")
    _in_range("seed", seed, 0, MAX_SEED, "in [0, 2^64)")
    return seed


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool, tuple[str, ...]]:
    """(include_usage, continuous_usage_stats, the options ignored)."""
    opts = _typed(body, "stream_options", (dict,), "an object", {})
    if opts and not stream:
        raise bad("'stream_options' is only allowed with stream: true", param="stream_options")
    unknown = set(opts) - fields.STREAM_OPTIONS - fields.STREAM_OPTIONS_IGNORED
    if unknown:
        raise bad(f"unknown stream_options field(s): {', '.join(sorted(unknown))}", param="stream_options")
    ignored = tuple(f"stream_options.{k}" for k in sorted(set(opts) & fields.STREAM_OPTIONS_IGNORED))
    return _flag(opts, "include_usage"), _flag(opts, "continuous_usage_stats"), ignored


def _max_tokens(body: dict, names: tuple[str, ...], least: int = 1) -> int | None:
    for name in names:
        value = _int(body, name)
        if value is not None:
            if value < least:
                raise bad(f"'{name}' must be at least {least}, got {value}", param=name)
            return value
    return None


def _token_ids(body: dict, name: str) -> tuple[int, ...]:
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad(f"'{name}' must be a list of token ids", param=name)
    return tuple(ids)


# ---------------------------------------------------------------- requests


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body: dict) -> tuple[str | tuple[int, ...], ...]:
    """The request's prompts: a string or a list of token ids is one; a list of those is several, one choice
    each (`index` in this order)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and not prompt:
        raise bad("'prompt' must not be empty", param="prompt")
    else:
        raise bad(
            "'prompt' must be a string, a list of token ids, or a list of either (several prompts)", param="prompt"
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} in one request", param="prompt")
    if any(not p for p in prompts):
        raise bad("'prompt' must not be empty (nor any of its prompts)", param="prompt")
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompts)


def _text(content: Any, where: str, allow_none: bool = False) -> str:
    """A message's content as text: a string or a list of text parts (None: '' where allowed)."""
    if content is None and allow_none:
        return ""
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad(f"{where}.content parts must all be {{'type': 'text', 'text': ...}}", "messages")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text parts", param="messages")
    return content


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as chat templates take them (arguments as an object where they
    parse as one)."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", param="messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad(
                f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                "'arguments': JSON text}}}}",
                param="messages",
            )
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            arguments = fn["arguments"]
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(c.get("id"), str):
            entry["id"] = c["id"]
        out.append(entry)
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}] must be an object with a role of system, user, assistant or tool", "messages")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        entry: dict[str, Any] = {
            "role": m["role"],
            "content": _text(m.get("content"), f"messages[{i}]", calls is not None),
        }
        if calls is not None:
            entry["tool_calls"] = _tool_calls(calls, f"messages[{i}]")
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            entry["tool_call_id"] = m["tool_call_id"]
        out.append(entry)
    return out


def _tools(body: dict) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """The functions the model may call (None: none offered, or `tool_choice` 'none'), and those it must call
    one of ('required': any; a named function: that one; None: no call forced)."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if tools is None:
        if choice not in (None, "auto", "none"):
            raise bad("'tool_choice' needs 'tools'", param="tool_choice")
        return None, None
    if not isinstance(tools, list) or not tools:
        raise bad("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(fn, dict)
            or t.get("type") != "function"
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise bad(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                param="tools",
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    tools = [_strict_tool(t) for t in tools]
    if choice in (None, "auto"):
        return tools, None
    if choice == "none":
        return None, None
    if choice == "required":
        return tools, tools
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    if not isinstance(name, str):
        raise bad(
            "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise bad(f"tool_choice names '{name}', which is not among 'tools'", param="tool_choice")
    return tools, named[:1]


def _strict_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool with `function.strict: true` takes its parameters in OpenAI's strict mode (`strict_schema`)."""
    fn = tool["function"]
    if fn.get("strict") is not True or not fn.get("parameters"):
        return tool
    return {**tool, "function": {**fn, "parameters": strict_schema(fn["parameters"])}}


def _several_calls(body: dict) -> bool:
    """Whether a constrained reply may hold more than one call: only where `parallel_tool_calls` is true and
    `tool_choice` names no function (vLLM's named choice is one call). Unset counts as false, not OpenAI's
    true: a small model forced into `call+` repeated its call to the length limit."""
    parallel = _typed(body, "parallel_tool_calls", (bool,), "true or false", False)
    return parallel and not isinstance(body.get("tool_choice"), dict)


def _response_format(body: dict) -> dict[str, Any] | None:
    """The JSON schema the reply must follow (None: free text); with `strict: true`, in OpenAI's strict mode."""
    fmt = body.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad(
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
            "'json_schema': {'name': ..., 'schema': {...}}}",
            param="response_format",
        )
    schema = spec.get("schema") or {}
    return strict_schema(schema) if spec.get("strict") is True else schema


def _structured(body: dict) -> dict[str, Any] | None:
    """The JSON schema the reply must follow: OpenAI's `response_format`, or vLLM's spellings of it, `guided_json`
    (a schema, or its JSON text) and `structured_outputs` (`{"json": schema}` or `{"json_object": true}`); at most
    one of the three."""
    given = [k for k in ("response_format", "guided_json", "structured_outputs") if body.get(k) is not None]
    if len(given) > 1:
        raise bad(f"give one of {', '.join(given)}: each asks for the reply's format", param=given[1])
    if given == ["guided_json"]:
        schema = body["guided_json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError:
                schema = None
        if not isinstance(schema, dict):
            raise bad("'guided_json' must be a JSON schema (an object, or its JSON text)", param="guided_json")
        return schema
    if given == ["structured_outputs"]:
        outputs = body["structured_outputs"]
        kinds = set(outputs) if isinstance(outputs, dict) else set()
        if kinds == {"json"} and isinstance(outputs["json"], (dict, str)):
            return _structured({"guided_json": outputs["json"]})
        if kinds == {"json_object"} and outputs["json_object"] is True:
            return {"type": "object"}
        raise bad(
            "structured_outputs must be {'json': schema} or {'json_object': true} here (regex, choice and "
            "grammar are not supported)",
            param="structured_outputs",
        )
    return _response_format(body)


def _common(body: dict, is_chat: bool) -> dict[str, Any]:
    _refuse_unsupported(body)
    model = _typed(body, "model", (str,), "a string")
    stream = _flag(body, "stream")
    if is_chat:
        want = _flag(body, "logprobs")
        top = _int(body, "top_logprobs", 0)
        _in_range("top_logprobs", top, 0, 20, "in [0, 20]")
        if top and not want:
            raise bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:  # legacy completions: logprobs is the number of alternatives
        top = _int(body, "logprobs")
        _in_range("logprobs", top, 0, 20, "in [0, 20]")
        want, top = top is not None, top or 0
    include_usage, continuous_usage, ignored_options = _stream_options(body, stream)
    min_tokens = _int(body, "min_tokens", 0)
    _in_range("min_tokens", min_tokens, 0, 1 << 30, ">= 0")
    return {
        "model": model,
        "sampling": _sampling(body, top, want),
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous_usage,
        "ignore_eos": _flag(body, "ignore_eos"),
        "return_token_ids": _flag(body, "return_token_ids"),
        "stop_token_ids": _token_ids(body, "stop_token_ids"),
        "min_tokens": min_tokens,
        "ignored": fields.ignored_fields(body, COMPLETION_FIELDS if not is_chat else CHAT_FIELDS) + ignored_options,
    }


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    _reject_unknown(body, COMPLETION_FIELDS)
    prompts = _prompts(body)
    common = _common(body, is_chat=False)
    echo = _flag(body, "echo")
    if echo and common["stream"] and common["sampling"].wants_logprobs:
        raise bad("echo with logprobs needs stream: false (the prompt's logprobs come with the whole reply)", "echo")
    max_tokens = _max_tokens(body, ("max_tokens",), least=0 if echo else 1)  # echo alone: the prompt's scores
    return ParsedRequest(
        False, prompts=prompts, messages=None, max_tokens=max_tokens, echo=echo, json_schema=_structured(body), **common
    )


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    _reject_unknown(body, CHAT_FIELDS)
    messages = _messages(body)
    tools, forced = _tools(body)
    schema = _structured(body)
    common = _common(body, is_chat=True)
    several = _several_calls(body)
    kwargs = _typed(body, "chat_template_kwargs", (dict,), 'an object (e.g. {"enable_thinking": false})')
    if kwargs and {"messages", "tools", "add_generation_prompt"} & set(kwargs):
        raise bad(
            "chat_template_kwargs may not set messages, tools or add_generation_prompt", param="chat_template_kwargs"
        )
    return ParsedRequest(
        True,
        prompts=(),
        messages=messages,
        tools=tools,
        forced_tools=forced,
        several_calls=several,
        json_schema=schema,
        template_kwargs=kwargs or None,
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens")),
        **common,
    )
