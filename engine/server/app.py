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
import logging
import secrets
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.grammar import Constraint, GrammarError
from engine.kernels.kernel_cache import module_files
from engine.request import FinishReason, GenerationRequest, StopCriteria
from engine.server import responses
from engine.server.context import ServerContext
from engine.server.http_edges import FramingCheck, HostCheck
from engine.server.protocol import ApiError, ParsedRequest, bad, parse_chat, parse_completion, parse_json
from engine.server.relay import Relay, finish, open_relays
from engine.server.sse import sse
from engine.server.tool_calls import writes_json_blocks

log = logging.getLogger("engine.server")


DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128K-token prompt is ~1 MB of ids or ~0.5 MB of text


@dataclass
class AppState:
    """What the routes read: the limits, set at start, and the context, set once the model is ready."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_hosts: frozenset[str] | None = None  # Host header names accepted; None: any
    ctx: ServerContext | None = None
    ignored_seen: set[str] = field(default_factory=set)  # ignored request fields the log has named


def compiled_modules(ctx: ServerContext) -> dict | None:
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


async def _prompt_ids(
    ctx: ServerContext, parsed: ParsedRequest, prompt: str | tuple[int, ...] | None
) -> tuple[int, ...]:
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
            raise bad(
                f"prompt token ids must be in [0, {ctx.vocab_size}); got {bad_ids[:5]}", "prompt", "invalid_token_id"
            )
        return prompt
    if parsed.messages is not None:
        if not tok.has_chat_template:
            raise bad("this model has no chat template; use /v1/completions", "messages")
        ids = await run_in_threadpool(
            tok.apply_chat_template, parsed.messages, True, parsed.tools, parsed.template_kwargs
        )
    else:
        ids = await run_in_threadpool(tok.encode, prompt)
    if not ids:
        raise bad("the prompt encodes to no tokens", "prompt")
    return tuple(ids)


def _constraint(ctx: ServerContext, parsed: ParsedRequest) -> Constraint | None:
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
                raise bad(
                    "a forced tool call needs a chat template that writes <tool_call> JSON blocks (--chat-template)",
                    param,
                )
            return ctx.grammars.tool_calls(parsed.forced_tools, parsed.several_calls)
        if parsed.tools and json_blocks:
            return ctx.grammars.call_or_json(parsed.tools, parsed.json_schema, parsed.several_calls)
        return ctx.grammars.json_schema(parsed.json_schema)
    except GrammarError as e:
        raise bad(
            f"the schema cannot be compiled: {e}", "tools" if param == "tool_choice" else param, "invalid_schema"
        ) from None


def _generation_request(
    ctx: ServerContext, parsed: ParsedRequest, prompt: tuple[int, ...], rid: str, constraint: Constraint | None = None
):
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
    sampling = replace(
        parsed.sampling,
        constraint=constraint,
        min_tokens=parsed.min_tokens,
        end_ids=frozenset(ctx.tokenizer.eos_ids) | frozenset(parsed.stop_token_ids),
    )
    scored = parsed.sampling.top_logprobs if parsed.echo and parsed.sampling.wants_logprobs else None
    return GenerationRequest(rid, prompt, sampling, stop, prompt_logprobs=scored)


async def _body(request: Request, limit: int) -> bytes:
    """The request's JSON body, read up to `limit` bytes: 413 past it (before reading it, where the length is
    declared), 415 for another content type."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(
            415,
            f"the body must be JSON (Content-Type: application/json), got '{kind or 'none'}'",
            code="unsupported_media_type",
        )
    too_large = ApiError(
        413,
        f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )
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
        raise ApiError(
            404,
            f"model '{parsed.model}' is not served here; this server serves '{ctx.model_id}'",
            "model",
            "model_not_found",
        )
    new = set(parsed.ignored) - state.ignored_seen
    if new:
        state.ignored_seen.update(new)
        log.info("accepted and ignored (first seen): %s", ", ".join(sorted(new)))
    rid = ("chatcmpl-" if is_chat else "cmpl-") + secrets.token_hex(12)
    constraint = await run_in_threadpool(_constraint, ctx, parsed)  # llguidance's first use reads the vocabulary
    prompts = parsed.prompts or (None,)
    gens = [
        _generation_request(
            ctx, parsed, await _prompt_ids(ctx, parsed, p), rid if len(prompts) == 1 else f"{rid}-{i}", constraint
        )
        for i, p in enumerate(prompts)
    ]
    return parsed, rid, gens


async def _cancel_on_disconnect(request: Request, relays: list[Relay]) -> None:
    """Wait for the client to go away (the body is read: the next message is the disconnect), then drop the
    rows, as a stream's end does."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for relay in relays:
        if relay.result is None:
            log.info("%s cancelled: the client went away before the response", relay.gen.request_id)
            relay.cancel()


async def _complete(ctx: ServerContext, state: AppState, request: Request, is_chat: bool) -> Response:
    try:
        with ctx.worker.arriving() as arrival:  # read and parsed while an idle engine gathers a burst
            parsed, rid, gens = await _prepare(ctx, state, request, is_chat)
            relays = await open_relays(ctx, parsed, rid, gens, arrival)
    except ApiError as e:
        return error_response(e)
    if parsed.stream:
        return StreamingResponse(sse(relays), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    watch = asyncio.ensure_future(_cancel_on_disconnect(request, relays))
    try:
        finishes = await asyncio.gather(*(finish(r) for r in relays))
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


# ------------------------------------------------------------------ routes


LOADING = ApiError(
    503, "the server is loading its model; retry when /health answers 200", code="loading", headers={"Retry-After": "5"}
)


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
        entry = {
            "id": ctx.model_id,
            "object": "model",
            "created": ctx.created,
            "owned_by": "engine",
            "max_context": ctx.max_context,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(request: Request) -> Response:
        if state.ctx is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok", "model": state.ctx.model_id})

    async def stats(ctx: ServerContext, request: Request) -> Response:
        return JSONResponse(
            {**ctx.worker.snapshot, "kernels": ctx.kernels.as_record(), "compiled_modules": compiled_modules(ctx)}
        )

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
    return Starlette(
        routes=routes,
        exception_handlers={404: not_found, 405: not_found},
        middleware=[Middleware(FramingCheck), Middleware(HostCheck, allowed=state.allowed_hosts)],
    )
