"""One request in flight, between the HTTP handler and the engine thread: `Relay` submits it and turns its
events into text, tokens, tool calls, reasoning and a result; a completions request with several prompts has a
relay per prompt (`open_relays`), all submitted before any is awaited so that they prefill and decode as rows of
one batch.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from engine.errors import RequestTooLarge
from engine.request import FinishReason, GeneratedToken, GenerationRequest
from engine.server import responses
from engine.server.context import ServerContext
from engine.server.detokenizer import StreamingDetokenizer
from engine.server.protocol import ApiError, ParsedRequest, bad
from engine.server.reasoning import ReasoningParser, opened
from engine.server.stop_text import TextStopper
from engine.server.tool_calls import CallDelta, Parsed
from engine.server.worker import Accepted, Arrival, Ended, QueueFull, Rejected

log = logging.getLogger("engine.server")


def rejection(error: Exception) -> ApiError:
    if isinstance(error, RequestTooLarge):
        return bad(str(error), "max_tokens", "kv_budget_exceeded")
    if isinstance(error, QueueFull):
        return ApiError(503, str(error), code="queue_full", headers={"Retry-After": str(error.retry_after_s)})
    if isinstance(error, ValueError):
        return bad(str(error))
    return ApiError(500, f"the engine refused the request: {error!r}")


class Relay:
    """One request in flight: submits it, then turns its events into text, tokens and a result."""

    def __init__(
        self, ctx: ServerContext, parsed: ParsedRequest, gen: GenerationRequest, response_id: str, index: int = 0
    ):
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
        self.stop_tokens: int | None = None  # tokens the output kept when a stop string ended it

    def text_of(self, token_id: int) -> str:
        return self.ctx.tokenizer.decode([token_id])

    def submit(self) -> None:
        self.ctx.worker.submit(self.gen, self.stream)

    async def accepted(self) -> None:
        """Wait for the engine to take the submitted request (raises the ApiError of a refusal)."""
        event = await self.stream.events.get()
        if isinstance(event, Rejected):
            raise rejection(event.error)
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

    def _finish(self) -> str | None:
        reason = self.result.finish_reason
        if reason is FinishReason.STOP and self.out.tool_calls:
            return "tool_calls"
        return reason.value if reason in (FinishReason.STOP, FinishReason.LENGTH) else None

    def usage(self) -> dict[str, Any]:
        p = self.placement
        return responses.usage(
            self.result, p.cached_tokens, self.stream, p.reason, self.ctx.kernels.tier, self.parsed.ignored
        )

    def usage_so_far(self) -> dict[str, int]:
        return responses.running_usage(len(self.gen.prompt_ids), len(self.out.tokens))

    def cancel(self, stop_tokens: int | None = None) -> None:
        """Drop the row (`stop_tokens`: a stop string ended the output there, which the engine records)."""
        if self.result is None and self.stream.alive:
            self.stream.alive = False
            self.ctx.worker.cancel(self.gen.request_id, stop_tokens)

    def log_line(self) -> None:
        r, t = self.result, self.stream.times.as_ms()
        log.info(
            "%s lane=%s prompt=%d completion=%d cached=%d batch=%d queue=%sms prefill=%sms ttft=%sms decode=%sms "
            "total=%sms finish=%s%s",
            r.request_id,
            r.lane.value,
            r.prompt_tokens,
            r.generated_tokens,
            self.placement.cached_tokens,
            self.stream.max_batch,
            t["queue"],
            t["prefill"],
            t["first_token"],
            t["decode"],
            t["total"],
            r.finish_reason.value,
            f" error={r.error}" if r.error else "",
        )

    def failure(self) -> ApiError:
        return ApiError(500, f"generation failed: {self.result.error}", code="engine_error")


async def open_relays(
    ctx: ServerContext, parsed: ParsedRequest, rid: str, gens: list[GenerationRequest], arrival: Arrival | None = None
) -> list[Relay]:
    """A relay per prompt, each submitted (all in the queue together, so they prefill and decode as rows of one
    batch; then the request's `arrival` is done); a refusal of any cancels those the engine took, and raises the
    first refusal."""
    relays = [Relay(ctx, parsed, gen, rid, i) for i, gen in enumerate(gens)]
    for relay in relays:
        relay.submit()
    if arrival is not None:
        arrival.done()  # before waiting for the engine to take them: a gathering engine takes them at its end
    refusals = []
    for relay in relays:
        try:
            await relay.accepted()
        except ApiError as e:
            refusals.append(e)
    if refusals:
        for relay in relays:
            if relay.placement is not None:
                relay.cancel()
        raise refusals[0]
    return relays


async def finish(relay: Relay) -> str | None:
    """Read a relay to its end: its finish reason."""
    finish = None
    async for delta in relay.events():
        finish = delta.finish
    return finish
