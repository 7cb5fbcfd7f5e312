"""The data that crosses the engine's boundaries: requests' settings and emitted tokens.

No MLX here: the scheduler, the gateway and the server use these without
touching arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Optional, Protocol, Sequence

from engine.errors import InvalidSamplingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    penalty_context_size: int = 20
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        return bool(self.logit_bias or self.repetition_penalty or self.presence_penalty or self.frequency_penalty)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    def validate(self, vocab_size: int) -> None:
        def fail(msg: str) -> None:
            raise InvalidSamplingError(msg)

        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            fail(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.top_k >= vocab_size:
            fail(f"top_k must be in [0, {vocab_size}), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens_to_keep < 1:
            fail(f"min_tokens_to_keep must be >= 1, got {self.min_tokens_to_keep}")
        if self.repetition_penalty is not None and self.repetition_penalty < 0:
            fail(f"repetition_penalty must be >= 0, got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= 20:
            fail(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        bad = [t for t in self.logit_bias if not 0 <= int(t) < vocab_size]
        if bad:
            fail(f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


class FinishReason(str, Enum):
    STOP = "stop"  # an EOS id or a stop sequence
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the caller cancelled, or its consumer went away
    ERROR = "error"  # the forward failed; the message says why


@dataclass(frozen=True)
class StopCriteria:
    max_tokens: int = 256
    eos_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    ignore_eos: bool = False  # fixed-length runs for benchmarks

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop sequences must not be empty")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class GeneratedToken:
    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Optional[tuple[TokenLogprob, ...]] = None
    finish_reason: Optional[FinishReason] = None
    # True for the EOS token or the last token of a stop sequence: it ends the
    # generation and its text is not part of the output.
    is_stop: bool = False

    def finished(self, reason: FinishReason, is_stop: bool = False) -> "GeneratedToken":
        return GeneratedToken(self.token_id, self.logprob, self.top_logprobs, reason, is_stop)


class _StopMatcher:
    """Withholds tokens that may be the start of a stop sequence until it is decided."""

    def __init__(self, sequences: Sequence[tuple[int, ...]]):
        self.sequences = [tuple(s) for s in sequences]
        self.pending: list[GeneratedToken] = []

    def push(self, tok: GeneratedToken) -> tuple[list[GeneratedToken], bool]:
        """Returns (tokens now safe to emit, whether a stop sequence completed)."""
        self.pending.append(tok)
        ids = tuple(t.token_id for t in self.pending)
        for seq in self.sequences:
            if len(ids) >= len(seq) and ids[-len(seq) :] == seq:
                safe = self.pending[: len(ids) - len(seq)]
                self.pending = []
                return safe, True
        keep = 0
        for seq in self.sequences:
            for n in range(min(len(seq) - 1, len(ids)), 0, -1):
                if ids[-n:] == seq[:n]:
                    keep = max(keep, n)
                    break
        safe = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return safe, False

    def flush(self) -> list[GeneratedToken]:
        out, self.pending = self.pending, []
        return out


class FinishTracker:
    """Decides, token by token, what a request emits and when it ends.

    `push` returns the tokens that may be emitted now; the last one carries the
    finish reason once the request is done. EOS and stop-sequence tokens come
    back flagged `is_stop`; tokens that may start a stop sequence are held back.
    """

    def __init__(self, stop: StopCriteria):
        self.stop = stop
        self.matcher = _StopMatcher(stop.stop_sequences)
        self.ids: list[int] = []  # every token pushed, withheld and stop tokens included
        self.done = False

    @property
    def generated(self) -> int:
        return len(self.ids)

    def push(self, tok: GeneratedToken) -> list[GeneratedToken]:
        assert not self.done, "push after the request finished"
        self.ids.append(tok.token_id)
        if not self.stop.ignore_eos and tok.token_id in self.stop.eos_ids:
            self.done = True
            return self.matcher.flush() + [tok.finished(FinishReason.STOP, is_stop=True)]
        safe, matched = self.matcher.push(tok)
        if matched:
            self.done = True
            return safe + [tok.finished(FinishReason.STOP, is_stop=True)]
        if self.generated >= self.stop.max_tokens:
            self.done = True
            rest = safe + self.matcher.flush()
            return rest[:-1] + [rest[-1].finished(FinishReason.LENGTH)]
        return safe


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stop: StopCriteria = StopCriteria()

    def __post_init__(self):
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.request_id}: the prompt must contain at least one token")


class Lane(str, Enum):
    SERIAL = "serial"  # alone on the device, the strict B=1 path
    CONTINUOUS = "continuous"  # the continuous-batching scheduler
    SPEC = "spec"  # speculative decoding, alone on the device like the serial lane


@dataclass
class SpecStats:
    """What speculation did for one request (the usage extension's `spec`).

    A round drafts up to `num_draft` tokens, verifies them in one target
    forward, and emits the accepted ones plus one token of the target's own
    (the correction, or the bonus when every draft was accepted).
    """

    kind: str
    num_draft: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0  # target forwards after the prompt: verifications plus replays
    rewinds: int = 0  # rounds that rejected a draft, so the target dropped what it had fed
    replays: int = 0  # forwards that rebuilt recurrent state after a rejection (the replay rollback)
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose draft position i was accepted
    drafted_at: list[int] = field(default_factory=list)  # rounds that drafted position i

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.num_draft
        self.drafted_at = self.drafted_at or [0] * self.num_draft

    def record_round(self, drafted: int, accepted: int, emitted: int, replayed: bool) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.target_calls += 1 + replayed
        self.rewinds += accepted < drafted
        self.replays += replayed
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def add(self, other: "SpecStats") -> None:
        """Pool another request's counts into these (same kind and draft count)."""
        for name in ("rounds", "drafted", "accepted", "target_calls", "rewinds", "replays", "emitted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        self.drafted_at = [a + b for a, b in zip(self.drafted_at, other.drafted_at)]

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.emitted / self.target_calls if self.target_calls else 0.0

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "num_draft": self.num_draft,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "acceptance": round(self.acceptance, 4),
            "target_calls": self.target_calls,
            "rewinds": self.rewinds,
            "replays": self.replays,
            "accepted_per_position": list(self.accepted_at),
            "drafted_per_position": list(self.drafted_at),
            "tokens_per_target_forward": round(self.tokens_per_target_forward, 4),
        }


@dataclass(frozen=True)
class CachedPrefix:
    """Single-row caches (opaque here) holding exactly `tokens`, for the prompt cache."""

    tokens: tuple[int, ...]
    cache: list


@dataclass(frozen=True)
class RequestResult:
    """How a request ended; the last thing its sink receives."""

    request_id: str
    lane: Lane
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    error: Optional[str] = None
    # For the prompt cache (empty when caches are not kept): the caches of the
    # prompt and the generated tokens that went through the model, and for
    # models whose caches cannot rewind also those at the prompt's boundary.
    caches: tuple[CachedPrefix, ...] = ()
    spec: Optional[SpecStats] = None  # on the spec lane: what speculation did


class TokenSink(Protocol):
    """Where a request's output goes (an SSE stream, a test's list, ...)."""

    def on_start(self) -> None:
        """The request left the queue: its prompt is going through the model now."""

    def on_token(self, token: GeneratedToken) -> Optional[bool]:
        """Receive one token; return False when the consumer is gone (the row is then dropped)."""

    def on_end(self, result: RequestResult) -> None:
        """The request is over, whichever way it ended."""


class ForwardingSink:
    """A TokenSink that passes every call to `inner`; subclasses add to the calls they override."""

    def __init__(self, inner: TokenSink):
        self.inner = inner

    def on_start(self) -> None:
        self.inner.on_start()

    def on_token(self, token: GeneratedToken) -> Optional[bool]:
        return self.inner.on_token(token)

    def on_end(self, result: RequestResult) -> None:
        self.inner.on_end(result)


@dataclass
class CollectingSink:
    """A TokenSink that keeps everything (tests, benchmarks, the CLI)."""

    tokens: list = field(default_factory=list)
    result: Optional[RequestResult] = None
    started: bool = False

    def on_start(self) -> None:
        self.started = True

    def on_token(self, token: GeneratedToken) -> Optional[bool]:
        self.tokens.append(token)
        return True

    def on_end(self, result: RequestResult) -> None:
        self.result = result

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens if not t.is_stop]
