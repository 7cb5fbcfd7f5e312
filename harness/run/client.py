"""One streamed completion request, timed event by event (httpx + SSE).

Times are milliseconds from the moment the request is sent: headers, first
byte, first content event (TTFT), every content event, end (E2EL). A content
event is an SSE chunk carrying output text or token ids; servers differ in
how many tokens a chunk carries (mlx_lm.server sends a chunk only when new
text appears), so output tokens are counted from `usage`, and
TPOT = (E2EL - TTFT) / (output tokens - 1), as vLLM's benchmark defines it.
A stream without `data: [DONE]`, a finish reason or usage is a failed
measurement, never a fast one.

Two limits end a request (`Timeouts`): `stall_s` without a byte (while
connecting, sending, or waiting for the next read) marks it `stalled`, the
sign of a hung server; `request_s` in all marks it `timed_out`. The total is
checked at every line the stream delivers; a stream that goes quiet is
caught by the stall limit, or by the total when that is the smaller.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# RequestRecord.timeout_kind
STALLED, TIMED_OUT = "stalled", "timed_out"


@dataclass(frozen=True)
class Timeouts:
    request_s: float = 1800  # one whole request
    stall_s: float = 300  # without a byte; a long prefill sends headers first, then nothing until its first token

    def for_httpx(self) -> httpx.Timeout:
        wait = min(self.stall_s, self.request_s)
        return httpx.Timeout(connect=wait, read=wait, write=wait, pool=self.request_s)


def prompt_sha256(prompt) -> str:
    """Identity of a prompt (token ids, or text) as sent: requests of two arms with equal hashes did the same work."""
    data = prompt if isinstance(prompt, str) else json.dumps(list(prompt))
    return hashlib.sha256(data.encode()).hexdigest()


@dataclass
class RequestRecord:
    phase: str
    attempt: int
    index: int
    prompt_tokens_sent: int
    ok: bool = False
    error: str | None = None
    timeout_kind: str | None = None  # STALLED | TIMED_OUT when a limit ended the request
    status_code: int | None = None
    sent_at: float = 0.0  # wall clock (time.time()) when sent
    headers_ms: float | None = None
    first_byte_ms: float | None = None
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    event_ms: list[float] = field(default_factory=list)  # content event arrivals
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    token_ids: list[int] | None = None  # when the server returns them
    usage: dict[str, Any] | None = None
    prompt_sha256: str | None = None  # of the prompt sent (`prompt_sha256`): the same request on every arm

    @property
    def output_sha256(self) -> str:
        """Identity of the output: of the token ids when known, else of the text."""
        data = json.dumps(self.token_ids) if self.token_ids is not None else self.text
        return hashlib.sha256(data.encode()).hexdigest()

    @property
    def text_sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2el_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def itl_ms(self) -> list[float]:
        return [b - a for a, b in zip(self.event_ms, self.event_ms[1:])]

    @property
    def decode_tps(self) -> float | None:
        """Output tokens after the first, per second after the first content event."""
        tpot = self.tpot_ms
        return None if not tpot else 1000.0 / tpot


def _content(event: dict) -> tuple[str, list[int] | None, str | None]:
    choice = event["choices"][0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content") or ""
    return text, choice.get("token_ids"), choice.get("finish_reason")


def stream_completion(
    client: httpx.Client, body: dict[str, Any], record: RequestRecord, timeouts: Timeouts = Timeouts()
) -> RequestRecord:
    """POST /v1/completions (/v1/chat/completions for a body with messages) with stream: true and fill `record`;
    never raises for a bad response or a limit."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    record.sent_at = time.time()
    start = time.perf_counter()

    def ms() -> float:
        return (time.perf_counter() - start) * 1000

    done, ids = False, []
    try:
        with client.stream("POST", path, json=body, timeout=timeouts.for_httpx()) as r:
            record.headers_ms, record.status_code = ms(), r.status_code
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}"
                return record
            for line in r.iter_lines():
                if record.first_byte_ms is None:
                    record.first_byte_ms = ms()
                if ms() > timeouts.request_s * 1000:
                    return _limit(record, TIMED_OUT, f"timed out: the request ran past {timeouts.request_s:g} s")
                if not line.startswith("data: "):
                    continue  # blank separators, `: keepalive` comments
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"error event: {json.dumps(event['error'])[:500]}"
                    return record
                if event.get("usage"):
                    record.usage = event["usage"]
                if not event.get("choices"):
                    continue
                text, got, finish = _content(event)
                if text or got:
                    now = ms()
                    record.event_ms.append(now)
                    if record.ttft_ms is None:
                        record.ttft_ms = now
                record.text += text
                if got is not None:
                    ids += got
                if finish:
                    record.finish_reason = finish
        record.e2el_ms = ms()
    except httpx.TimeoutException as e:
        if isinstance(e, httpx.PoolTimeout) or timeouts.request_s <= timeouts.stall_s:
            return _limit(record, TIMED_OUT, f"timed out: the request ran past {timeouts.request_s:g} s")
        return _limit(record, STALLED, f"stalled: no bytes for {timeouts.stall_s:g} s ({type(e).__name__})")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as e:
        record.error = f"{type(e).__name__}: {e}"  # a broken connection, or SSE that is not the protocol
        return record
    record.token_ids = ids if ids else None
    usage = record.usage or {}
    record.output_tokens = usage.get("completion_tokens")
    record.prompt_tokens = usage.get("prompt_tokens")
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    missing = [
        n
        for n, v in (
            ("[DONE]", done),
            ("finish_reason", record.finish_reason),
            ("usage", record.usage),
            ("a content event", record.ttft_ms is not None),
        )
        if not v
    ]
    if missing:
        record.error = "incomplete stream: no " + ", no ".join(missing)
    else:
        record.ok = True
    return record


def _limit(record: RequestRecord, kind: str, error: str) -> RequestRecord:
    record.timeout_kind, record.error = kind, error
    return record
