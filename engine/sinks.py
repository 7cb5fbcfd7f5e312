"""Where a request's output goes: the TokenSink protocol, and the sinks that forward or collect."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.request import GeneratedToken, RequestResult


class TokenSink(Protocol):
    """Where a request's output goes (an SSE stream, a test's list, ...)."""

    def on_start(self) -> None:
        """The request left the queue: its prompt is going through the model now."""

    def on_token(self, token: GeneratedToken) -> bool | None:
        """Receive one token; return False when the consumer is gone (the row is then dropped)."""

    def on_end(self, result: RequestResult) -> None:
        """The request is over, whichever way it ended."""


class ForwardingSink:
    """A TokenSink that passes every call to `inner`; subclasses add to the calls they override."""

    def __init__(self, inner: TokenSink):
        self.inner = inner

    def on_start(self) -> None:
        self.inner.on_start()

    def on_token(self, token: GeneratedToken) -> bool | None:
        return self.inner.on_token(token)

    def on_end(self, result: RequestResult) -> None:
        self.inner.on_end(result)


@dataclass
class CollectingSink:
    """A TokenSink that keeps everything (tests, benchmarks, the CLI)."""

    tokens: list = field(default_factory=list)
    result: RequestResult | None = None
    started: bool = False

    def on_start(self) -> None:
        self.started = True

    def on_token(self, token: GeneratedToken) -> bool | None:
        self.tokens.append(token)
        return True

    def on_end(self, result: RequestResult) -> None:
        self.result = result

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens if not t.is_stop]
