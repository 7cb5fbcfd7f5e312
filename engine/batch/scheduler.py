"""The continuous-batching scheduler: every decision, no arrays (no MLX import).

One loop iteration, in the order mlx-lm's BatchGenerator uses (so the same-B
oracle sees the same batch at every forward):

  1. one decode step for the running rows; their tokens go through each
     request's FinishTracker; finished rows are evicted;
  2. admission: if no joiner is in flight, the head of the FIFO queue starts
     prefilling when a row is free and its projected KV bytes fit the budget
     (head-of-line: the queue is never reordered, running rows are never
     evicted to make room);
  3. the joiner advances by one prefill chunk of its prompt (all but the last
     token), or, when only the last token is left, takes its first token from
     an L=1 forward on its own caches; it joins the batch unless it finished
     right there.

The runner executes what this decides; the batcher drives both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from engine.errors import EngineError
from engine.types import FinishReason, FinishTracker, GeneratedToken, GenerationRequest


class RequestTooLarge(EngineError, ValueError):
    """A request whose projected KV bytes exceed the whole budget."""


class SeqStatus(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int = 8
    prefill_chunk: int = 2048
    kv_budget_bytes: Optional[int] = None

    def __post_init__(self):
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


@dataclass(eq=False)
class Sequence:
    """The scheduler's view of one request."""

    request: GenerationRequest
    kv_bytes: int
    tracker: FinishTracker
    status: SeqStatus = SeqStatus.WAITING
    prefilled: int = 0  # prompt tokens (all but the last) already through the model
    # The token in this row's input register was already emitted (token 0 at join):
    # the next decode step reads it back and must not emit it twice.
    input_emitted: bool = False
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None
    generated: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_body(self) -> tuple[int, ...]:
        return self.request.prompt_ids[:-1]


class JoinerAction(Enum):
    PREFILL = "prefill"
    FIRST_TOKEN = "first_token"


@dataclass(frozen=True)
class JoinerWork:
    action: JoinerAction
    seq: Sequence
    tokens: tuple[int, ...]  # the chunk to prefill, or (last prompt token,)
    is_new: bool = False  # the joiner was admitted in this iteration


@dataclass(frozen=True)
class Emission:
    seq: Sequence
    tokens: tuple[GeneratedToken, ...]


@dataclass(frozen=True)
class DecodeOutcome:
    emissions: tuple[Emission, ...]
    finished: tuple[Sequence, ...]
    keep: tuple[int, ...]  # surviving row indices, in order


@dataclass
class Scheduler:
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    pending: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    joiner: Optional[Sequence] = None
    hold_admission: bool = False  # a serial-lane request is waiting: let the batch drain

    # ---------------------------------------------------------------- intake

    def submit(self, request: GenerationRequest, kv_bytes: int) -> Sequence:
        budget = self.config.kv_budget_bytes
        if budget is not None and kv_bytes > budget:
            raise RequestTooLarge(
                f"request {request.request_id} needs {kv_bytes:,} bytes of KV cache (prompt "
                f"{len(request.prompt_ids)} + max_tokens {request.stop.max_tokens}) but the whole budget is "
                f"{budget:,} bytes; lower max_tokens or raise the KV budget"
            )
        seq = Sequence(request, kv_bytes, FinishTracker(request.stop))
        self.pending.append(seq)
        return seq

    def find(self, request_id: str) -> Optional[Sequence]:
        for seq in (*self.pending, *self.running, *([self.joiner] if self.joiner else [])):
            if seq.request_id == request_id:
                return seq
        return None

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: Optional[str] = None):
        """Mark a request finished; queued ones leave now, joiners and rows at the next iteration."""
        seq = self.find(request_id)
        if seq is None or seq.status is SeqStatus.DONE:
            return None
        seq.finish_reason, seq.error = reason, error
        if seq.status is SeqStatus.WAITING:
            self.pending.remove(seq)
            seq.status = SeqStatus.DONE
        return seq

    # ------------------------------------------------------------- counters

    @property
    def active_rows(self) -> int:
        return len(self.running) + (1 if self.joiner else 0)

    @property
    def pending_rows(self) -> int:
        return len(self.pending)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.joiner or (self.pending and not self.hold_admission))

    @property
    def kv_bytes(self) -> int:
        """Projected bytes of the running rows and the joiner."""
        return sum(s.kv_bytes for s in self.running) + (self.joiner.kv_bytes if self.joiner else 0)

    # ------------------------------------------------------------ iteration

    def cancelled_rows(self) -> tuple[list[Sequence], tuple[int, ...]]:
        """Running rows cancelled since the last step, and the indices that stay."""
        gone = [s for s in self.running if s.finish_reason is not None]
        if not gone:
            return [], tuple(range(len(self.running)))
        keep = tuple(i for i, s in enumerate(self.running) if s.finish_reason is None)
        self._evict(gone)
        return gone, keep

    def on_decoded(self, tokens: list[GeneratedToken]) -> DecodeOutcome:
        """Apply one decode step's tokens (one per running row, in row order)."""
        assert len(tokens) == len(self.running), (len(tokens), len(self.running))
        emissions, finished = [], []
        for seq, tok in zip(self.running, tokens):
            if seq.input_emitted:
                seq.input_emitted = False
                continue
            out = self._push(seq, tok)
            if out:
                emissions.append(Emission(seq, tuple(out)))
            if seq.tracker.done:
                finished.append(seq)
        keep = tuple(i for i, s in enumerate(self.running) if not s.tracker.done)
        self._evict(finished)
        return DecodeOutcome(tuple(emissions), tuple(finished), keep)

    def joiner_work(self) -> Optional[JoinerWork]:
        is_new = False
        if self.joiner is not None and self.joiner.finish_reason is not None:
            return None  # cancelled mid-prefill: the batcher drops it first
        if self.joiner is None:
            if not self._can_admit():
                return None
            self.joiner = self.pending.popleft()
            self.joiner.status = SeqStatus.PREFILLING
            is_new = True
        seq = self.joiner
        body = seq.prompt_body
        if seq.prefilled < len(body):
            chunk = body[seq.prefilled : seq.prefilled + self.config.prefill_chunk]
            return JoinerWork(JoinerAction.PREFILL, seq, tuple(chunk), is_new)
        return JoinerWork(JoinerAction.FIRST_TOKEN, seq, (seq.request.prompt_ids[-1],), is_new)

    def on_prefilled(self, n: int) -> None:
        assert self.joiner is not None
        self.joiner.prefilled += n

    def on_first_token(self, tok: GeneratedToken) -> tuple[tuple[GeneratedToken, ...], bool]:
        """Token 0 of the joiner: returns (tokens to emit, whether the row joins the batch)."""
        seq = self.joiner
        assert seq is not None
        out = tuple(self._push(seq, tok))
        self.joiner = None
        if seq.tracker.done:
            seq.status = SeqStatus.DONE
            return out, False
        seq.status = SeqStatus.RUNNING
        seq.input_emitted = True
        self.running.append(seq)
        return out, True

    def drop_joiner(self, reason: FinishReason, error: Optional[str] = None) -> Sequence:
        seq = self.joiner
        assert seq is not None
        self.joiner = None
        seq.status = SeqStatus.DONE
        if seq.finish_reason is None:
            seq.finish_reason, seq.error = reason, error
        return seq

    def fail_running(self, error: str) -> list[Sequence]:
        failed = list(self.running)
        for s in failed:
            s.finish_reason, s.error = FinishReason.ERROR, error
        self._evict(failed)
        return failed

    # -------------------------------------------------------------- helpers

    def _push(self, seq: Sequence, tok: GeneratedToken) -> list[GeneratedToken]:
        seq.generated += 1
        out = seq.tracker.push(tok)
        if seq.tracker.done and seq.finish_reason is None:
            seq.finish_reason = out[-1].finish_reason
        return out

    def _evict(self, seqs: list[Sequence]) -> None:
        gone = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in gone]
        for s in seqs:
            s.status = SeqStatus.DONE

    def _can_admit(self) -> bool:
        if not self.pending or self.hold_admission or len(self.running) >= self.config.max_rows:
            return False
        budget = self.config.kv_budget_bytes
        return budget is None or self.kv_bytes + self.pending[0].kv_bytes <= budget
