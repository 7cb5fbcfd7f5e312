"""A streamed reply as server-sent events: each relay's chunks as they come (several prompts' merged), the
usage where asked, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.request import FinishReason
from engine.server import responses
from engine.server.relay import Relay

log = logging.getLogger("engine.server")


def sse_event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chunks(relay: Relay) -> AsyncIterator[str]:
    """One relay's SSE events (its choice's), those of the engine events already at hand in one piece; with
    continuous usage, each chunk carries the usage so far."""
    parsed, out = relay.parsed, relay.out
    ids = parsed.return_token_ids
    pending: list[str] = []

    def event(obj: dict[str, Any]) -> str:
        if parsed.include_usage and parsed.continuous_usage:
            obj["usage"] = relay.usage_so_far()
        return sse_event(obj)

    if parsed.is_chat:
        pending.append(event(responses.chunk(out, "", [], None, relay.text_of, ids, role=True)))
    elif out.echo_text:
        pending.append(event(responses.chunk(out, out.echo_text, [], None, relay.text_of, ids)))
    async for delta in relay.events():
        if relay.result is not None and relay.result.finish_reason is FinishReason.ERROR:
            pending.append(sse_event(relay.failure().body()))
            break
        # the text, then what it streams of tool calls, then the finish (with the text where no call came); the
        # tokens go with the text, or with the first call chunk where there is none
        text_finish = None if delta.calls else delta.finish
        has_text = delta.text or delta.reasoning or text_finish or (delta.tokens and not delta.calls)
        if has_text:
            pending.append(
                event(
                    responses.chunk(
                        out, delta.text, delta.tokens, text_finish, relay.text_of, ids, reasoning=delta.reasoning
                    )
                )
            )
        call_tokens = [] if has_text else delta.tokens
        pending += [event(piece) for piece in responses.call_chunks(out, delta.calls, relay.text_of, ids, call_tokens)]
        if delta.calls and delta.finish:
            pending.append(event(responses.chunk(out, "", [], delta.finish, relay.text_of, ids)))
        if pending and relay.stream.events.empty():
            yield "".join(pending)
            pending.clear()
    if pending:
        yield "".join(pending)


async def merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
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


async def sse(relays: list[Relay]) -> AsyncIterator[str]:
    """The response's SSE events: every choice's, as they come, then the usage (where asked) and [DONE]."""
    parsed = relays[0].parsed
    try:
        async for piece in merged([chunks(r) for r in relays]):
            yield piece
        done = "data: [DONE]\n\n"
        if parsed.include_usage and all(r.result.finish_reason is not FinishReason.ERROR for r in relays):
            usage = responses.total_usage([r.usage() for r in relays])
            done = sse_event(responses.usage_chunk(relays[0].out, usage)) + done
        yield done
        for relay in relays:
            relay.log_line()
    finally:
        for relay in relays:
            if relay.result is None:  # the client went away mid-stream: drop the row
                log.info(
                    "%s cancelled: the client went away after %d tokens", relay.gen.request_id, len(relay.out.tokens)
                )
                relay.cancel()
