"""The continuous-batching scheduler: every decision, no arrays (no MLX import).

One loop iteration, in the order mlx-lm's BatchGenerator uses (so the same-B
oracle sees the same batch at every forward):

  1. one decode step for the running rows; their tokens go through each
     request's FinishTracker; finished rows are evicted;
  2. admission: queued requests join the prefill group (up to
     `prefill_batch` joiners, and never more rows than `max_rows` in all)
     strictly in FIFO order while their projected KV bytes fit the budget
     (head-of-line: the queue is never reordered, running rows are never
     evicted to make room);
  3. joiners whose prompt (all but its last token) is through the model take
     token 0 from an L=1 forward of the last token on their own caches, and
     join the batch unless they finished right there;
  4. the other joiners advance by one prefill chunk each, in one right-padded
     forward.

The runner executes what this decides; the batcher drives both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import Enum

from engine.errors import RequestTooLarge
from engine.request import FinishReason, GeneratedToken, GenerationRequest
from engine.stopping import FinishTracker


def check_budget(request: GenerationRequest, kv_bytes: int, budget: int | None, draft_bytes: int = 0) -> None:
    """Raise RequestTooLarge when `kv_bytes` (`draft_bytes` of them a draft model's) can never fit the budget
    (None: no budget)."""
    if budget is not None and kv_bytes > budget:
        draft = f", {draft_bytes:,} of them for the draft model's KV cache" if draft_bytes else ""
        raise RequestTooLarge(
            f"request {request.request_id} needs {kv_bytes:,} bytes of KV cache (prompt {len(request.prompt_ids)} "
            f"tokens + max_tokens {request.stop.max_tokens}{draft}) but the whole KV budget is {budget:,} bytes; "
            "lower max_tokens, shorten the prompt, or raise the KV budget (`engine serve --kv-budget`)"
        )


class SeqStatus(Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    DONE = "done"


@dataclass(frozen=True)
class SchedulerConfig:
    max_rows: int = 8  # rows decoding and prefilling together (the --batch cap)
    prefill_chunk: int = 2048  # prompt tokens per joiner per iteration
    prefill_batch: int = 8  # joiners prefilled together (mlx_lm.server's --prompt-concurrency)
    kv_budget_bytes: int | None = None
    # Prompt tokens all joiners take in one iteration, shared equally (each at most prefill_chunk): a burst of
    # long prompts then holds the decoding rows for about one such forward a step. None: prefill_chunk each.
    prefill_budget: int | None = None
    # The budget while no row decodes (no prefill holds a row's next token up): fewer, larger forwards, where a
    # forward's fixed cost is paid once for more prompts. None: the prefill budget; it never lowers it.
    idle_prefill_budget: int | None = None
    # The prefill forwards' chunk buckets (a forward is padded to the smallest that holds its longest chunk): with a
    # budget, a joiner's share is rounded down to the largest bucket within it, so no forward pads its chunks.
    chunk_buckets: tuple[int, ...] = ()
    # Quantized KV: a prefill group is fresh (no joiner in it has run a chunk) or quantized (every joiner has,
    # or starts from a cached prefix), and a queued prompt joins only a group of its own kind: the group's caches
    # are quantized after a chunk, a fresh prompt's first chunk must attend to full-precision keys (the serial
    # scheme's, mlx-lm's kv_bits), and a cached prefix is quantized already.
    kv_groups: bool = False

    def __post_init__(self):
        for name in ("max_rows", "prefill_chunk", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_budget", "idle_prefill_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def chunk(self, joiners: int, cap: int | None = None, idle: bool = False) -> int:
        """Prompt tokens each of `joiners` prefilling joiners takes this iteration: its share of the budget (the
        idle budget where `idle`, no row decoding; and of `cap`, the pacer's tokens for this iteration, where
        smaller), rounded down to a chunk bucket where one fits (31 joiners of 2048: 64 tokens each, not 66
        padded to 96), up to the smallest where none does (a forward pads to it anyway). A cap of 0: none."""
        if cap == 0:
            return 0
        budget = self.prefill_budget
        if idle and budget is not None and self.idle_prefill_budget is not None:
            budget = max(budget, self.idle_prefill_budget)
        budget = min((b for b in (budget, cap) if b is not None), default=None)
        if budget is None or joiners == 0:
            return self.prefill_chunk
        share = max(1, min(self.prefill_chunk, budget // joiners))
        return max((b for b in self.chunk_buckets if b <= share), default=min(self.chunk_buckets, default=share))


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
    spec: bool = False  # decodes as a spec row (engine.batch.spec_rows): several tokens a step
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def generated(self) -> int:
        return self.tracker.generated

    @property
    def prompt_body(self) -> tuple[int, ...]:
        return self.request.prompt_ids[:-1]


@dataclass(frozen=True)
class DecodePlan:
    """The running rows' share of one iteration (step 1 above)."""

    evicted: tuple[Sequence, ...]  # rows cancelled since the last step: they leave before the forward
    rows: tuple[str, ...]  # the rows that decode, by request id, in batch order (none: no decode step)


@dataclass(frozen=True)
class PrefillPlan:
    """The joiners' share of one iteration (step 2-4 above), in group order."""

    evicted: tuple[Sequence, ...]  # joiners cancelled since the last step: they leave the group first
    admitted: tuple[Sequence, ...]  # new joiners, appended to the group
    first_tokens: tuple[Sequence, ...]  # prompt done: take token 0 now
    chunks: tuple[tuple[Sequence, tuple[int, ...]], ...]  # the next chunk of every other joiner

    @property
    def is_empty(self) -> bool:
        """Nothing to run (evictions aside)."""
        return not (self.admitted or self.first_tokens or self.chunks)

    def without(self, request_ids: Collection[str]) -> PrefillPlan:
        """This plan less the given joiners (those that failed on their own)."""
        return PrefillPlan(
            self.evicted,
            tuple(s for s in self.admitted if s.request_id not in request_ids),
            tuple(s for s in self.first_tokens if s.request_id not in request_ids),
            tuple((s, c) for s, c in self.chunks if s.request_id not in request_ids),
        )


@dataclass(frozen=True)
class Emission:
    seq: Sequence
    tokens: tuple[GeneratedToken, ...]


@dataclass(frozen=True)
class DecodeOutcome:
    emissions: tuple[Emission, ...]
    finished: tuple[Sequence, ...]  # rows done with this step: they leave the batch


@dataclass(frozen=True)
class FirstToken:
    """A joiner's token 0: what it emits, and whether it joins the batch (not finished right there)."""

    seq: Sequence
    tokens: tuple[GeneratedToken, ...]
    joins: bool


@dataclass
class Scheduler:
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    pending: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    joiners: list = field(default_factory=list)  # the prefill group, in order
    hold_admission: bool = False  # a serial-lane request is waiting: let the batch drain

    # ---------------------------------------------------------------- intake

    def submit(
        self, request: GenerationRequest, kv_bytes: int, cached: int = 0, spec: bool = False, draft_bytes: int = 0
    ) -> Sequence:
        """Queue a request projecting `kv_bytes` (`draft_bytes` of them its draft model's caches); its first
        `cached` prompt tokens come from a prompt-cache hit; `spec`: it decodes as a spec row."""
        if not 0 <= cached < len(request.prompt_ids):
            raise ValueError(f"cached must be in [0, {len(request.prompt_ids)}), got {cached}")
        check_budget(request, kv_bytes, self.config.kv_budget_bytes, draft_bytes)
        seq = Sequence(request, kv_bytes, FinishTracker(request.stop), prefilled=cached, spec=spec)
        self.pending.append(seq)
        return seq

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.pending, *self.running, *self.joiners):
            if seq.request_id == request_id:
                return seq
        return None

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None):
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
        return len(self.running) + len(self.joiners)

    @property
    def pending_rows(self) -> int:
        return len(self.pending)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.joiners or (self.pending and not self.hold_admission))

    @property
    def kv_bytes(self) -> int:
        """Projected bytes of the running rows and the joiners."""
        return sum(s.kv_bytes for s in (*self.running, *self.joiners))

    # ------------------------------------------------------------ iteration

    def schedule_decode(self) -> DecodePlan:
        """Step 1's plan: the running rows cancelled since the last step leave; the others decode."""
        gone = [s for s in self.running if s.finish_reason is not None]
        if gone:
            self._evict(gone)
        return DecodePlan(tuple(gone), tuple(s.request_id for s in self.running))

    def update_decode(self, tokens: Mapping[str, GeneratedToken | tuple[GeneratedToken, ...]]) -> DecodeOutcome:
        """Apply one decode step's tokens (one per running row, by request id, in row order; a spec row's are a
        tuple, all new, pushed until its request is done)."""
        assert list(tokens) == [s.request_id for s in self.running], (list(tokens), len(self.running))
        emissions, finished = [], []
        for seq, tok in zip(self.running, tokens.values()):
            if isinstance(tok, tuple):
                seq.input_emitted = False
                out = []
                for t in tok:
                    out += self._push(seq, t)
                    if seq.tracker.done:
                        break
            elif seq.input_emitted:
                seq.input_emitted = False
                continue
            else:
                out = self._push(seq, tok)
            if out:
                emissions.append(Emission(seq, tuple(out)))
            if seq.tracker.done:
                finished.append(seq)
        self._evict(finished)
        return DecodeOutcome(tuple(emissions), tuple(finished))

    def schedule_prefill(self, cap: int | None = None) -> PrefillPlan:
        """Steps 2-4's plan: joiners cancelled since the last step leave, then admission, then which joiners
        take token 0 and which advance by a chunk (of `cap` prompt tokens in all at most, past the smallest chunk
        bucket each; 0: none advances)."""
        gone = [s for s in self.joiners if s.finish_reason is not None]
        if gone:
            self.joiners = [s for s in self.joiners if s.finish_reason is None]
            for s in gone:
                s.status = SeqStatus.DONE
        admitted = []
        while self._can_admit():
            seq = self.pending.popleft()
            seq.status = SeqStatus.PREFILLING
            self.joiners.append(seq)
            admitted.append(seq)
        first = tuple(s for s in self.joiners if s.prefilled >= len(s.prompt_body))
        prefilling = [s for s in self.joiners if s.prefilled < len(s.prompt_body)]
        idle = not self.running and not first  # no row decodes beside this forward, nor right after it
        size = self.config.chunk(len(prefilling), cap, idle)
        chunks = tuple((s, s.prompt_body[s.prefilled : s.prefilled + size]) for s in prefilling if size)
        return PrefillPlan(tuple(gone), tuple(admitted), first, chunks)

    def update_first_tokens(self, tokens: Mapping[str, GeneratedToken]) -> tuple[FirstToken, ...]:
        """Token 0 of each joiner whose prompt is through (by request id, in group order)."""
        ready = [s for s in self.joiners if s.prefilled >= len(s.prompt_body)]
        assert [s.request_id for s in ready] == list(tokens), ([s.request_id for s in ready], list(tokens))
        self.joiners = [s for s in self.joiners if s.prefilled < len(s.prompt_body)]
        out = []
        for seq, tok in zip(ready, tokens.values()):
            emitted = tuple(self._push(seq, tok))
            joins = not seq.tracker.done
            if joins:
                seq.status = SeqStatus.RUNNING
                seq.input_emitted = True
                self.running.append(seq)
            else:
                seq.status = SeqStatus.DONE
            out.append(FirstToken(seq, emitted, joins))
        return tuple(out)

    def update_prefill(self, plan: PrefillPlan) -> None:
        """The plan's chunks went through the model."""
        for seq, chunk in plan.chunks:
            seq.prefilled += len(chunk)

    def fail_joiners(self, error: str) -> list[Sequence]:
        failed, self.joiners = self.joiners, []
        for s in failed:
            s.status = SeqStatus.DONE
            if s.finish_reason is None:
                s.finish_reason, s.error = FinishReason.ERROR, error
        return failed

    def fail_one(self, request_id: str, error: str) -> Sequence | None:
        """A joiner or running row that failed on its own leaves now; the others go on."""
        seq = next((s for s in (*self.joiners, *self.running) if s.request_id == request_id), None)
        if seq is None:
            return None
        self.joiners = [s for s in self.joiners if s is not seq]
        self._evict([seq])
        if seq.finish_reason is None:
            seq.finish_reason, seq.error = FinishReason.ERROR, error
        return seq

    def fail_running(self, error: str) -> list[Sequence]:
        failed = list(self.running)
        for s in failed:
            s.finish_reason, s.error = FinishReason.ERROR, error
        self._evict(failed)
        return failed

    # -------------------------------------------------------------- helpers

    def _push(self, seq: Sequence, tok: GeneratedToken) -> list[GeneratedToken]:
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
        if not self.pending or self.hold_admission or len(self.joiners) >= self.config.prefill_batch:
            return False
        if self.joiners and self.pending[0].spec != self.joiners[0].spec:
            return False  # a prefill group is all spec rows or all plain rows: plain joiners' padding is their own
        if self.config.kv_groups and self.joiners:
            if (self.pending[0].prefilled > 0) != any(s.prefilled > 0 for s in self.joiners):
                return False
        if len(self.running) + len(self.joiners) >= self.config.max_rows:
            return False
        budget = self.config.kv_budget_bytes
        return budget is None or self.kv_bytes + self.pending[0].kv_bytes <= budget
