"""How a cell's requests go to the server: all at once, at offsets (open loop), or as chats of turns, each
request streamed in a thread of its own; and the (body, record) pairs they are sent as."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from harness.run import cells
from harness.run.client import RequestRecord, Timeouts, prompt_sha256, stream_completion


def at_once(client: httpx.Client, pairs: list[tuple[dict, RequestRecord]], timeouts: Timeouts) -> None:
    pool = ThreadPoolExecutor(len(pairs))
    try:
        list(pool.map(lambda br: stream_completion(client, *br, timeouts), pairs))
    finally:
        # On a signal, do not wait for the streams: stopping the server ends them.
        pool.shutdown(wait=False, cancel_futures=True)


def request_pairs(
    phase: str, attempt: int, prompts: list, max_tokens: int, extra_body: dict
) -> list[tuple[dict, RequestRecord]]:
    """(body, record) for each prompt: token ids to /v1/completions; a multi-turn chat's messages to the chat
    endpoint, where the server's template makes the prompt (no thinking block)."""
    common = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if (kind := cells.kind_of(phase)) and kind.chat:
        return [
            (
                {**p, **common, "chat_template_kwargs": {"enable_thinking": False}, **extra_body},
                RequestRecord(phase, attempt, i, 0, prompt_sha256=prompt_sha256(json.dumps(p["messages"]))),
            )
            for i, p in enumerate(prompts)
        ]
    return [
        (
            {"prompt": p, **common, **extra_body},
            RequestRecord(phase, attempt, i, len(p), prompt_sha256=prompt_sha256(p)),
        )
        for i, p in enumerate(prompts)
    ]


def open_loop(
    client: httpx.Client,
    pairs: list[tuple[dict, RequestRecord]],
    at: Sequence[float],
    max_concurrency: int | None,
    timeouts: Timeouts,
) -> None:
    """Each request sent at its offset (s) from now, whatever the others are doing, at most `max_concurrency`
    in flight (a later arrival then waits its turn, and its TTFT counts the wait, as vLLM's does)."""
    start = time.perf_counter()
    gate = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None

    def send(i: int) -> None:
        time.sleep(max(0.0, start + at[i] - time.perf_counter()))
        if gate is None:
            stream_completion(client, *pairs[i], timeouts)
            return
        with gate:
            stream_completion(client, *pairs[i], timeouts)

    pool = ThreadPoolExecutor(len(pairs))
    try:
        list(pool.map(send, range(len(pairs))))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def chats(client: httpx.Client, conversations: list[list[tuple[dict, RequestRecord]]], timeouts: Timeouts) -> None:
    """Each chat in a thread of its own, its turns one after another."""
    pool = ThreadPoolExecutor(max(len(conversations), 1))
    try:
        list(pool.map(lambda turns: [stream_completion(client, *t, timeouts) for t in turns], conversations))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
