"""The HTTP layer: Starlette routes that turn OpenAI requests into engine requests and events into JSON/SSE.

Handlers never touch the model: they tokenize, validate, hand the request to
the engine thread and relay its events. Bad input is answered with an
OpenAI-style error body and a 4xx; the server stays up whatever the body.
Before any of it, the HTTP edges (`engine.server.http_edges`) refuse ambiguous
framing and a Host that is not served here, and a POST must carry a JSON body of
at most `AppState.max_body_bytes`.
Until the model is loaded and warm (`AppState.ctx` unset) every route
answers 503 and /health says "loading".
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import RequestTooLarge
from engine.grammar import Constraint, GrammarError, Grammars
from engine.kernels import KernelSet
from engine.kernels.kernel_cache import module_files
from engine.server import responses
from engine.server.detokenizer import StreamingDetokenizer
from engine.server.http_edges import FramingCheck, HostCheck
from engine.server.reasoning import ReasoningParser, opened
from engine.server.protocol import ApiError, ParsedRequest, bad, parse_chat, parse_completion, parse_json
from engine.server.stop_text import TextStopper
from engine.server.tool_calls import CallDelta, Parsed, Parser, writes_json_blocks
from engine.server.worker import Accepted, EngineWorker, Ended, QueueFull, Rejected
from engine.tokenizer import Tokenizer
from engine.request import FinishReason, GeneratedToken, GenerationRequest, StopCriteria

if TYPE_CHECKING:
    from engine.server.metrics import Metrics

log = logging.getLogger("engine.server")


@dataclass(frozen=True)
class ServerContext:
    worker: EngineWorker
    tokenizer: Tokenizer
    model_id: str
    model_aliases: frozenset[str]  # other names a request may use for the served model
    vocab_size: int  # the model's embedding rows: token ids must be below this
    max_context: int  # prompt + completion tokens at most
    default_max_tokens: int
    api_key: Optional[str]
    created: int
    kernels: KernelSet  # the kernel tier the model runs: in every usage and in /stats
    metrics: Optional["Metrics"] = None  # /metrics (None: prometheus_client is not installed)
    tool_parser: Optional[Parser] = None  # the chat template's tool-call format (None: it renders no tools)
    grammars: Optional[Grammars] = None  # constrained decoding (response_format, forced tool calls)
    reasoning: bool = False  # the chat template thinks: <think> blocks go to reasoning_content
    kernel_cache_dir: Optional[Path] = None  # MLX_PTX_CACHE_DIR: /stats counts the modules compiled into it
    modules_at_ready: Optional[int] = None  # how many it held at ready (`kernel_cache.module_files`)


DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128K-token prompt is ~1 MB of ids or ~0.5 MB of text


@dataclass
class AppState:
    """What the routes read: the limits, set at start, and the context, set once the model is ready."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_hosts: Optional[frozenset[str]] = None  # Host header names accepted; None: any
    ctx: Optional[ServerContext] = None
    ignored_seen: set[str] = field(default_factory=set)  # ignored request fields the log has named


def compiled_modules(ctx: ServerContext) -> Optional[dict]:
    """The kernel cache directory's compiled modules, and those written since ready (each a compilation that
    requests waited for); None without a directory."""
    files = module_files(ctx.kernel_cache_dir)
    if files is None or ctx.modules_at_ready is None:
        return None
    return {"directory": str(ctx.kernel_cache_dir), "files": files, "since_ready": files - ctx.modules_at_ready}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# ------------------------------------------------------------ preparation


def _check_auth(ctx: ServerContext, request: Request) -> None:
    if ctx.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {ctx.api_key}".encode()):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


def _too_long(ctx: ServerContext, parsed: ParsedRequest, tokens: int, at_least: bool = False) -> ApiError:
    return bad(
        f"the prompt has {'at least ' * at_least}{tokens} tokens but this server's context is {ctx.max_context} "
        "tokens (prompt and completion together); shorten the prompt",
        "prompt" if not parsed.is_chat else "messages",
        "context_length_exceeded",
    )


async def _prompt_ids(ctx: ServerContext, parsed: ParsedRequest, prompt: str | tuple[int, ...] | None) -> tuple[int, ...]:
    """The token ids of one of a completion's prompts, or of a chat's messages (`prompt` None)."""
    tok = ctx.tokenizer
    # A text prompt far over the context is refused before it is tokenized (seconds of CPU for megabytes).
    chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in parsed.messages or ())
    fewest = -(-chars // tok.max_token_chars())
    if fewest >= ctx.max_context:
        raise _too_long(ctx, parsed, fewest, at_least=True)
    if isinstance(prompt, tuple):
        bad_ids = [t for t in prompt if not 0 <= t < ctx.vocab_size]
        if bad_ids:
            raise bad(f"prompt token ids must be in [0, {ctx.vocab_size}); got {bad_ids[:5]}", "prompt", "invalid_token_id")
        return prompt
    if parsed.messages is not None:
        if not tok.has_chat_template:
            raise bad("this model has no chat template; use /v1/completions", "messages")
        ids = await run_in_threadpool(tok.apply_chat_template, parsed.messages, True, parsed.tools,
                                      parsed.template_kwargs)  # fmt: skip
    else:
        ids = await run_in_threadpool(tok.encode, prompt)
    if not ids:
        raise bad("the prompt encodes to no tokens", "prompt")
    return tuple(ids)


def _constraint(ctx: ServerContext, parsed: ParsedRequest) -> Optional[Constraint]:
    """The grammar the reply must follow: a forced tool call's (response_format then applies to nothing), else
    the response_format's schema, or where tools are offered in the JSON blocks a grammar writes, a call or the
    schema's JSON (400 for what cannot be compiled, naming the problem)."""
    if parsed.json_schema is None and parsed.forced_tools is None:
        return None
    param = "tool_choice" if parsed.forced_tools is not None else "response_format"
    if ctx.grammars is None:
        raise bad("this server has no constrained decoding", param)
    if parsed.ignore_eos:
        raise bad("ignore_eos does not combine with a constrained reply (it ends at the grammar's end)", "ignore_eos")
    json_blocks = writes_json_blocks(ctx.tool_parser)
    try:
        if parsed.forced_tools is not None:
            if not json_blocks:
                raise bad("a forced tool call needs a chat template that writes <tool_call> JSON blocks "
                          "(--chat-template)", param)  # fmt: skip
            return ctx.grammars.tool_calls(parsed.forced_tools, parsed.several_calls)
        if parsed.tools and json_blocks:
            return ctx.grammars.call_or_json(parsed.tools, parsed.json_schema, parsed.several_calls)
        return ctx.grammars.json_schema(parsed.json_schema)
    except GrammarError as e:
        raise bad(f"the schema cannot be compiled: {e}", "tools" if param == "tool_choice" else param,
                  "invalid_schema") from None  # fmt: skip


def _generation_request(ctx: ServerContext, parsed: ParsedRequest, prompt: tuple[int, ...], rid: str,
                        constraint: Optional[Constraint] = None):  # fmt: skip
    n = len(prompt)
    if n >= ctx.max_context:
        raise _too_long(ctx, parsed, n)
    max_tokens = parsed.max_tokens
    if max_tokens == 0:  # echo alone: the prompt through the model (its last token's forward included), no token kept
        max_tokens = 1
    if max_tokens is None:
        max_tokens = min(ctx.default_max_tokens, ctx.max_context - n)
    elif n + max_tokens > ctx.max_context:
        raise bad(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds this server's context of "
            f"{ctx.max_context} tokens; lower max_tokens to at most {ctx.max_context - n}",
            "max_tokens",
            "context_length_exceeded",
        )
    try:
        parsed.sampling.validate(ctx.vocab_size)
    except ValueError as e:
        raise bad(str(e)) from None
    stops = tuple(tuple(ctx.tokenizer.encode(s, add_special_tokens=False)) for s in parsed.stop)
    stops += tuple((t,) for t in parsed.stop_token_ids)
    stop = StopCriteria(max_tokens, ctx.tokenizer.eos_ids, tuple(s for s in stops if s), parsed.ignore_eos)
    sampling = replace(parsed.sampling, constraint=constraint, min_tokens=parsed.min_tokens,
                       end_ids=frozenset(ctx.tokenizer.eos_ids) | frozenset(parsed.stop_token_ids))  # fmt: skip
    scored = parsed.sampling.top_logprobs if parsed.echo and parsed.sampling.wants_logprobs else None
    return GenerationRequest(rid, prompt, sampling, stop, prompt_logprobs=scored)


async def _body(request: Request, limit: int) -> bytes:
    """The request's JSON body, read up to `limit` bytes: 413 past it (before reading it, where the length is
    declared), 415 for another content type."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the body must be JSON (Content-Type: application/json), got '{kind or 'none'}'",
                       code="unsupported_media_type")  # fmt: skip
    too_large = ApiError(413, f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
                         code="request_too_large")  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _prepare(ctx: ServerContext, state: AppState, request: Request, is_chat: bool):
    """The parsed request and a generation request per prompt (one for a chat), ids `RID` or `RID-i`."""
    _check_auth(ctx, request)
    parsed = (parse_chat if is_chat else parse_completion)(parse_json(await _body(request, state.max_body_bytes)))
    if parsed.model is not None and parsed.model != ctx.model_id and parsed.model not in ctx.model_aliases:
        raise ApiError(404, f"model '{parsed.model}' is not served here; this server serves '{ctx.model_id}'",
                       "model", "model_not_found")  # fmt: skip
    new = set(parsed.ignored) - state.ignored_seen
    if new:
        state.ignored_seen.update(new)
        log.info("accepted and ignored (first seen): %s", ", ".join(sorted(new)))
    rid = ("chatcmpl-" if is_chat else "cmpl-") + secrets.token_hex(12)
    constraint = await run_in_threadpool(_constraint, ctx, parsed)  # llguidance's first use reads the vocabulary
    prompts = parsed.prompts or (None,)
    gens = [_generation_request(ctx, parsed, await _prompt_ids(ctx, parsed, p), rid if len(prompts) == 1 else f"{rid}-{i}",
                                constraint) for i, p in enumerate(prompts)]  # fmt: skip
    return parsed, rid, gens


def _rejection(error: Exception) -> ApiError:
    if isinstance(error, RequestTooLarge):
        return bad(str(error), "max_tokens", "kv_budget_exceeded")
    if isinstance(error, QueueFull):
        return ApiError(503, str(error), code="queue_full", headers={"Retry-After": str(error.retry_after_s)})
    if isinstance(error, ValueError):
        return bad(str(error))
    return ApiError(500, f"the engine refused the request: {error!r}")


# -------------------------------------------------------------- handlers


class _Relay:
    """One request in flight: submits it, then turns its events into text, tokens and a result."""

    def __init__(self, ctx: ServerContext, parsed: ParsedRequest, gen: GenerationRequest, response_id: str,
                 index: int = 0):  # fmt: skip
        self.ctx, self.parsed, self.gen = ctx, parsed, gen
        self.stream = ctx.worker.stream(gen.request_id)
        self.out = responses.Output(response_id, ctx.model_id, parsed.is_chat, index)
        if parsed.echo:  # the prompt as sent (its text, or its ids' text), its tokens scored when they come
            prompt = parsed.prompts[index]
            self.out.echo_text = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(list(prompt))
            self.out.echo_tokens = [GeneratedToken(t) for t in gen.prompt_ids]
        self.echo_only = parsed.max_tokens == 0  # the prompt's token through the model, no token kept
        self.detok = StreamingDetokenizer(ctx.tokenizer.decode)
        self.stopper = TextStopper(parsed.stop)
        # tool calls parsed out of the text where the request offers tools and the template writes calls
        self.tools = ctx.tool_parser() if parsed.tools and ctx.tool_parser is not None else None
        # the reply's reasoning apart, starting inside the block where the prompt opened it
        self.reasoning = None
        if ctx.reasoning and parsed.is_chat:
            self.reasoning = ReasoningParser(inside=opened(ctx.tokenizer.decode(list(gen.prompt_ids[-16:]))))
        self.placement = None
        self.result = None
        self.stop_tokens: Optional[int] = None  # tokens the output kept when a stop string ended it

    def text_of(self, token_id: int) -> str:
        return self.ctx.tokenizer.decode([token_id])

    async def open(self) -> None:
        self.ctx.worker.submit(self.gen, self.stream)
        event = await self.stream.events.get()
        if isinstance(event, Rejected):
            raise _rejection(event.error)
        assert isinstance(event, Accepted), event
        self.placement = event.placement

    async def events(self) -> AsyncIterator[responses.Delta]:
        """What each engine event adds (content, reasoning, tokens, tool calls; the finish reason at the end),
        until the end."""
        while True:
            event = await self.stream.events.get()
            if isinstance(event, Ended):
                self.result = self._stopped(event.result)
                if self.result.prompt_logprobs:
                    self.out.echo_tokens = [self.out.echo_tokens[0], *self.result.prompt_logprobs]
                delta = self._content(self.stopper.push(self.detok.flush()) + self.stopper.flush(), [], True)
                yield replace(delta, finish=self._finish())
                return
            tok = event.token
            if self.stopper.stopped or self.echo_only:
                continue  # a stop string already ended the output (the engine is dropping the row), or none is kept
            tokens = [] if tok.is_stop else [tok]
            if tok.is_stop:
                self.out.end_token = tok
            text = self.stopper.push(self.detok.add(tok.token_id) if tokens else self.detok.flush())
            self.out.tokens += tokens
            delta = self._content(text, tokens)
            if self.stopper.stopped:
                self.stop_tokens = len(self.out.tokens)
                self.cancel(stop_tokens=self.stop_tokens)
            yield delta

    def _content(self, text: str, tokens: list, end: bool = False) -> responses.Delta:
        """The text split into reasoning, content and tool calls (what to stream of them; those that ended go
        to the output); all content where the template neither thinks nor the request offers tools."""
        reasoning = ""
        if self.reasoning is not None:
            parts = [self.reasoning.push(text)] + ([self.reasoning.flush()] if end else [])
            reasoning, text = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        calls: tuple[CallDelta, ...] = ()
        if self.tools is not None:
            parsed = self.tools.push(text) + (self.tools.flush() if end else Parsed())
            text, calls = parsed.content, parsed.deltas
            self.out.tool_calls += parsed.calls
        self.out.text += text
        self.out.reasoning += reasoning
        return responses.Delta(text, tokens, None, calls, reasoning)

    def _stopped(self, result):
        """The engine's result as the client sees it: a stop string's end is a stop with the tokens up to the
        one that completed it, however many more the engine made before the cancel reached it."""
        if result.finish_reason is FinishReason.ERROR:
            return result
        if self.echo_only:
            return replace(result, finish_reason=FinishReason.LENGTH, generated_tokens=0)
        if self.stop_tokens is None:
            return result
        return replace(result, finish_reason=FinishReason.STOP, generated_tokens=self.stop_tokens)

    def _finish(self) -> Optional[str]:
        reason = self.result.finish_reason
        if reason is FinishReason.STOP and self.out.tool_calls:
            return "tool_calls"
        return reason.value if reason in (FinishReason.STOP, FinishReason.LENGTH) else None

    def usage(self) -> dict[str, Any]:
        p = self.placement
        return responses.usage(self.result, p.cached_tokens, self.stream, p.reason, self.ctx.kernels.tier,
                               self.parsed.ignored)  # fmt: skip

    def usage_so_far(self) -> dict[str, int]:
        return responses.running_usage(len(self.gen.prompt_ids), len(self.out.tokens))

    def cancel(self, stop_tokens: Optional[int] = None) -> None:
        """Drop the row (`stop_tokens`: a stop string ended the output there, which the engine records)."""
        if self.result is None and self.stream.alive:
            self.stream.alive = False
            self.ctx.worker.cancel(self.gen.request_id, stop_tokens)

    def log_line(self) -> None:
        r, t = self.result, self.stream.times.as_ms()
        log.info(
            "%s lane=%s prompt=%d completion=%d cached=%d batch=%d queue=%sms prefill=%sms ttft=%sms decode=%sms "
            "total=%sms finish=%s%s",
            r.request_id, r.lane.value, r.prompt_tokens, r.generated_tokens, self.placement.cached_tokens,
            self.stream.max_batch, t["queue"], t["prefill"], t["first_token"], t["decode"], t["total"],
            r.finish_reason.value, f" error={r.error}" if r.error else "",
        )  # fmt: skip

    def failure(self) -> ApiError:
        return ApiError(500, f"generation failed: {self.result.error}", code="engine_error")


async def _cancel_on_disconnect(request: Request, relays: list[_Relay]) -> None:
    """Wait for the client to go away (the body is read: the next message is the disconnect), then drop the
    rows, as a stream's end does."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for relay in relays:
        if relay.result is None:
            log.info("%s cancelled: the client went away before the response", relay.gen.request_id)
            relay.cancel()


async def _open(ctx: ServerContext, parsed: ParsedRequest, rid: str, gens: list[GenerationRequest]) -> list[_Relay]:
    """A relay per prompt, each submitted (all in the queue together, so they prefill and decode as rows of one
    batch); a refusal of any cancels those already in."""
    relays = [_Relay(ctx, parsed, gen, rid, i) for i, gen in enumerate(gens)]
    try:
        for relay in relays:
            await relay.open()
    except ApiError:
        for relay in relays:
            if relay.placement is not None:
                relay.cancel()
        raise
    return relays


async def _finish(relay: _Relay) -> Optional[str]:
    """Read a relay to its end: its finish reason."""
    finish = None
    async for delta in relay.events():
        finish = delta.finish
    return finish


async def _complete(ctx: ServerContext, state: AppState, request: Request, is_chat: bool) -> Response:
    try:
        parsed, rid, gens = await _prepare(ctx, state, request, is_chat)
        relays = await _open(ctx, parsed, rid, gens)
    except ApiError as e:
        return error_response(e)
    if parsed.stream:
        return StreamingResponse(_sse(relays), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    watch = asyncio.ensure_future(_cancel_on_disconnect(request, relays))
    try:
        finishes = await asyncio.gather(*(_finish(r) for r in relays))
    finally:
        watch.cancel()
        for relay in relays:
            relay.cancel()  # no-op once the result is in; otherwise the handler itself was cancelled
    for relay in relays:
        relay.log_line()
    failed = [r for r in relays if r.result.finish_reason is FinishReason.ERROR]
    if failed:
        return error_response(failed[0].failure())
    usage = responses.total_usage([r.usage() for r in relays])
    outs = [(r.out, finish) for r, finish in zip(relays, finishes)]
    return JSONResponse(responses.body(outs, usage, relays[0].text_of, parsed.return_token_ids))


def _sse_event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _chunks(relay: _Relay) -> AsyncIterator[str]:
    """One relay's SSE events (its choice's), those of the engine events already at hand in one piece; with
    continuous usage, each chunk carries the usage so far."""
    parsed, out = relay.parsed, relay.out
    ids = parsed.return_token_ids
    pending: list[str] = []

    def event(obj: dict[str, Any]) -> str:
        if parsed.include_usage and parsed.continuous_usage:
            obj["usage"] = relay.usage_so_far()
        return _sse_event(obj)

    if parsed.is_chat:
        pending.append(event(responses.chunk(out, "", [], None, relay.text_of, ids, role=True)))
    elif out.echo_text:
        pending.append(event(responses.chunk(out, out.echo_text, [], None, relay.text_of, ids)))
    async for delta in relay.events():
        if relay.result is not None and relay.result.finish_reason is FinishReason.ERROR:
            pending.append(_sse_event(relay.failure().body()))
            break
        # the text, then what it streams of tool calls, then the finish (with the text where no call came); the
        # tokens go with the text, or with the first call chunk where there is none
        text_finish = None if delta.calls else delta.finish
        has_text = delta.text or delta.reasoning or text_finish or (delta.tokens and not delta.calls)
        if has_text:
            pending.append(event(responses.chunk(out, delta.text, delta.tokens, text_finish, relay.text_of,
                                                 ids, reasoning=delta.reasoning)))  # fmt: skip
        call_tokens = [] if has_text else delta.tokens
        pending += [event(piece) for piece in responses.call_chunks(out, delta.calls, relay.text_of, ids, call_tokens)]
        if delta.calls and delta.finish:
            pending.append(event(responses.chunk(out, "", [], delta.finish, relay.text_of, ids)))
        if pending and relay.stream.events.empty():
            yield "".join(pending)
            pending.clear()
    if pending:
        yield "".join(pending)


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The pieces of several streams as each comes (one stream: its own)."""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        ended = 0
        while ended < len(tasks):
            piece = await queue.get()
            if piece is None:
                ended += 1
            else:
                yield piece
    finally:
        for task in tasks:
            task.cancel()


async def _sse(relays: list[_Relay]) -> AsyncIterator[str]:
    """The response's SSE events: every choice's, as they come, then the usage (where asked) and [DONE]."""
    parsed = relays[0].parsed
    try:
        async for piece in _merged([_chunks(r) for r in relays]):
            yield piece
        done = "data: [DONE]\n\n"
        if parsed.include_usage and all(r.result.finish_reason is not FinishReason.ERROR for r in relays):
            usage = responses.total_usage([r.usage() for r in relays])
            done = _sse_event(responses.usage_chunk(relays[0].out, usage)) + done
        yield done
        for relay in relays:
            relay.log_line()
    finally:
        for relay in relays:
            if relay.result is None:  # the client went away mid-stream: drop the row
                log.info("%s cancelled: the client went away after %d tokens", relay.gen.request_id,
                         len(relay.out.tokens))  # fmt: skip
                relay.cancel()


# ------------------------------------------------------------------ routes


LOADING = ApiError(503, "the server is loading its model; retry when /health answers 200", code="loading",
                   headers={"Retry-After": "5"})  # fmt: skip


def make_app(state: AppState) -> Starlette:
    """The routes over `state` (its context set once the model is ready)."""

    def ready(handler, auth: bool = True):
        async def route(request: Request) -> Response:
            ctx = state.ctx
            if ctx is None:
                return error_response(LOADING)
            try:
                if auth:
                    _check_auth(ctx, request)
                return await handler(ctx, request)
            except ApiError as e:
                return error_response(e)

        return route

    async def completions(ctx: ServerContext, request: Request) -> Response:
        return await _complete(ctx, state, request, is_chat=False)

    async def chat(ctx: ServerContext, request: Request) -> Response:
        return await _complete(ctx, state, request, is_chat=True)

    async def models(ctx: ServerContext, request: Request) -> Response:
        entry = {"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "engine",
                 "max_context": ctx.max_context}  # fmt: skip
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(request: Request) -> Response:
        if state.ctx is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok", "model": state.ctx.model_id})

    async def stats(ctx: ServerContext, request: Request) -> Response:
        return JSONResponse({**ctx.worker.snapshot, "kernels": ctx.kernels.as_record(),
                             "compiled_modules": compiled_modules(ctx)})  # fmt: skip

    async def metrics(ctx: ServerContext, request: Request) -> Response:
        if ctx.metrics is None:
            raise ApiError(501, "metrics need the prometheus_client package", code="metrics_unavailable")
        body, content_type = ctx.metrics.exposition(ctx.worker.snapshot)
        return Response(body, media_type=content_type)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        msg = "method not allowed" if status == 405 else f"no route {request.url.path}"
        return error_response(ApiError(status, msg, code="not_found" if status == 404 else "method_not_allowed"))

    # /completions take their auth in _prepare; /health is open to all, for load balancers and launchers
    routes = [
        Route("/v1/completions", ready(completions, auth=False), methods=["POST"]),
        Route("/v1/chat/completions", ready(chat, auth=False), methods=["POST"]),
        Route("/v1/models", ready(models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", ready(stats), methods=["GET"]),
        Route("/metrics", ready(metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found},
                     middleware=[Middleware(FramingCheck), Middleware(HostCheck, allowed=state.allowed_hosts)])  # fmt: skip
