"""A request and what comes back for it: its sampling and stopping settings, the tokens it emits, how it
ended. No MLX here: the scheduler, the gateway and the server use these without touching arrays.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidSamplingError

if TYPE_CHECKING:
    from engine.grammar import Constraint


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_context_size: int = 20
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None  # a grammar the output must follow (engine.grammar)
    min_tokens: int = 0  # none of `end_ids` before this many tokens (vLLM's min_tokens)
    end_ids: frozenset[int] = frozenset()  # the tokens that would end the output: EOS, stop token ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        return bool(
            self.logit_bias
            or self.repetition_penalty
            or self.presence_penalty
            or self.frequency_penalty
            or self.constraint
            or self.min_tokens
        )

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
    logprob: float | None = None
    top_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: FinishReason | None = None
    # True for the EOS token or the last token of a stop sequence: it ends the
    # generation and its text is not part of the output.
    is_stop: bool = False

    def finished(self, reason: FinishReason, is_stop: bool = False) -> GeneratedToken:
        return GeneratedToken(self.token_id, self.logprob, self.top_logprobs, reason, is_stop)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    stop: StopCriteria = StopCriteria()
    # score the prompt (engine.prompt_logprobs), each token with this many alternatives; None: not scored
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.request_id}: the prompt must contain at least one token")


class Lane(str, Enum):
    SERIAL = "serial"  # alone on the device, the strict B=1 path
    CONTINUOUS = "continuous"  # the continuous-batching scheduler
    SPEC = "spec"  # speculative decoding, alone on the device like the serial lane


@dataclass(frozen=True)
class CachedPrefix:
    """Single-row caches (opaque here) holding exactly `tokens`, for the prompt cache; `snapshots`: (n, the
    layers that cannot rewind as they were after the first n tokens, None for the others), taken at block
    boundaries of the prefill (`prompt_cache.snapshot`); `draft`: a draft source's state after `tokens` (the
    speculative lane's MTP head, `speculative.mtp.MTPState`: its `kind` and `nbytes`), or None; `full_chunk`: with
    quantized KV, how many first tokens went through the model in a chunk that attended to full-precision keys
    (the prompt's first prefill chunk, as mlx-lm's kv_bits does it), None without."""

    tokens: tuple[int, ...]
    cache: list
    snapshots: tuple[tuple[int, list], ...] = ()
    draft: Any = None
    full_chunk: int | None = None


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
    # Spec rows in the continuous batch (engine/batch/spec_rows.py), which step together: the verify windows that
    # fed drafts, the seconds from building each such window's forward to its tokens read and its rollback done,
    # and the seconds the batched draft took to propose (a draft model or the MTP head), all the row group's.
    windows: int = 0
    window_seconds: float = 0.0
    draft_seconds: float = 0.0

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

    def add(self, other: SpecStats) -> None:
        """Pool another request's counts into these (same kind and draft count)."""
        counts = ("rounds", "drafted", "accepted", "target_calls", "rewinds", "replays", "emitted", "windows")
        for name in counts + ("window_seconds", "draft_seconds"):
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
            "windows": self.windows,
            "ms_per_window": round(1e3 * self.window_seconds / self.windows, 3) if self.windows else None,
            "draft_ms_per_round": round(1e3 * self.draft_seconds / self.rounds, 3) if self.rounds else None,
        }


@dataclass(frozen=True)
class RequestResult:
    """How a request ended; the last thing its sink receives."""

    request_id: str
    lane: Lane
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    error: str | None = None
    # For the prompt cache (empty when caches are not kept): the caches of the
    # prompt and the generated tokens that went through the model, and for
    # models whose caches cannot rewind also those at the prompt's boundary.
    caches: tuple[CachedPrefix, ...] = ()
    spec: SpecStats | None = None  # on the spec lane: what speculation did
    prompt_logprobs: tuple[GeneratedToken, ...] = ()  # prompt tokens 1.. scored, where the request asked
