"""The continuous batcher: each phase of an iteration is schedule -> execute -> update.

The scheduler plans a phase (`DecodePlan`, `PrefillPlan`: who leaves, who
decodes, who joins, takes token 0 or a prefill chunk, by request), the runner
runs it on the arrays and answers by request id (`RowTokens`), the scheduler
takes the tokens back (`update_decode`, `update_first_tokens`), and the
batcher delivers them to the requests' sinks. The prefill phase is planned
after the decode phase has run, as mlx-lm's BatchGenerator orders them, so
that the rows that finish in a decode step free their room first.

Containment:
- a request whose consumer fails (its sink raises) or goes away (returns
  False) is removed alone, before the next forward;
- a row whose own sampling fails (its sampler or processors cannot be set
  up or raise, its token cannot be emitted) fails alone, whether it is
  joining or decoding; the others keep the tokens they would have had;
- any other error in a decode step (the forward) cannot be pinned on one
  row: every running row fails with the error and the batch caches are
  dropped; the loop goes on serving the queue;
- any other error while prefilling fails the joiners of that prefill group only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import mlx.nn as nn

from engine.batch.kv_budget import KVLayout
from engine.batch.kv_layout import kv_layout
from engine.batch.pacing import PacingConfig, PrefillPacer
from engine.batch.runner import BatchRunner, Joiner, LogitsTap, RowFailure
from engine.batch.scheduler import DecodePlan, PrefillPlan, Scheduler, SchedulerConfig, SeqStatus, Sequence
from engine.batch.spec_rows import SpecRows
from engine.cache import KVCache, cache_nbytes, own
from engine.cache.prompt_cache import keep_at, markable, snapshot, snapshot_at, unmark
from engine.generate import KVQuantization
from engine.request import (
    CachedPrefix,
    FinishReason,
    GeneratedToken,
    GenerationRequest,
    Lane,
    RequestResult,
    SpecStats,
)
from engine.sinks import TokenSink

log = logging.getLogger(__name__)


class ContinuousBatcher:
    def __init__(
        self,
        model: nn.Module,
        config: SchedulerConfig = SchedulerConfig(),
        tap: LogitsTap | None = None,
        keep_caches: bool = False,
        keep_budget: Callable[[], int | None] | None = None,
        kv_quantization: KVQuantization | None = None,
        decode_buckets: tuple[int, ...] = (),
        chunk_buckets: tuple[int, ...] = (),
        group_buckets: tuple[int, ...] = (),
        snapshot_block: int = 0,
        layout: KVLayout | None = None,
        spec: SpecRows | None = None,
        pacing: PacingConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.runner = BatchRunner(model, tap, kv_quantization, decode_buckets, chunk_buckets, group_buckets, spec)
        # the rows' KV projection for the budget: the caller's `layout` (the gateway's), else built here
        self.layout: KVLayout = layout if layout is not None else kv_layout(model, kv_quantization)
        self.keep_caches = keep_caches
        # The prompt cache's budget (`PromptCache.copy_budget`): the boundary and block-snapshot copies held for
        # running rows stay within it, earlier copies first (one past it would be refused on insertion or evict
        # one that fits); None: no bound.
        self.keep_budget = keep_budget
        # Caches that cannot rewind are reusable only at stored boundaries: keep the prompt's too, and block
        # snapshots every `snapshot_block` prompt tokens, kept from inside the prefill forwards (`keep_at`: the
        # chunks are the same as without); none where a layer that cannot rewind keeps no state inside one.
        self.keep_boundaries = keep_caches and not all(c.is_trimmable() for c in model.make_cache())
        self.snapshot_block = snapshot_block if self.keep_boundaries and markable(model.make_cache()) else 0
        # the layers a snapshot copies: all but plain KV, which the stored entry's own caches stand in for
        self._snapshot_layers = {i for i, c in enumerate(model.make_cache()) if type(c) is not KVCache}
        self.quantized = kv_quantization is not None
        self.scheduler = Scheduler(dataclasses.replace(config, kv_groups=self.quantized))
        # Quantized KV: each request's first chunk, the one that attended to full-precision keys (its prefix's
        # where it started from one), for the prompt cache (`CachedPrefix.full_chunk`).
        self._full_chunks: dict[str, int | None] = {}
        self._sinks: dict[str, TokenSink] = {}
        self._prefixes: dict[str, list] = {}  # prompt-cache hits waiting for admission
        self._boundaries: dict[str, CachedPrefix] = {}  # prompt-boundary caches of running rows
        self._snapshots: dict[str, list[tuple[int, list]]] = {}  # their block snapshots (`prompt_cache.snapshot`)
        self._copied: dict[str, int] = {}  # the bytes of each running request's boundary and snapshot copies
        self._scores: dict[str, tuple[GeneratedToken, ...]] = {}  # scored prompts, for their results
        # Prefill pacing (`engine.batch.pacing`): the last readback's time and rows, and what ran since it.
        self.pacer = PrefillPacer(pacing) if pacing is not None else None
        self._clock = clock
        self._read_at: float | None = None
        self._read_rows = 0
        self._prefilled = 0  # prompt tokens prefilled since the last readback
        self._joined = False  # joiners took token 0 since it (their forward is in the gap: not a measurement)

    # ---------------------------------------------------------------- intake

    def submit(
        self,
        request: GenerationRequest,
        sink: TokenSink,
        prefix: CachedPrefix | None = None,
        kv_bytes: int | None = None,
        spec: bool = False,
    ) -> None:
        """Queue a request (raises RequestTooLarge if it can never fit the KV budget).

        `prefix`: caches holding the first len(prefix.tokens) prompt tokens; prefill starts after them.
        `kv_bytes`: the row's projected KV bytes where the caller has them (`layout.row_bytes`), the target's.
        `spec`: it decodes as a spec row (the batcher was made with `spec` rows); with a draft model its
        projection adds the draft's caches (`draft_bytes`).
        """
        if request.request_id in self._sinks:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        if spec and self.runner.spec is None:
            raise ValueError("this batcher has no spec rows")
        if kv_bytes is None:
            # a spec row's verify window writes up to num_draft columns past its tokens before the trim
            extra = self.runner.spec.num_draft if spec else 0
            kv_bytes = self.layout.row_bytes(len(request.prompt_ids), request.stop.max_tokens + extra)
        draft = self.draft_bytes(request) if spec else 0
        cached = len(prefix.tokens) if prefix else 0
        self.scheduler.submit(request, kv_bytes + draft, cached=cached, spec=spec, draft_bytes=draft)
        self._sinks[request.request_id] = sink
        if prefix is not None:
            self._prefixes[request.request_id] = prefix.cache
            self._full_chunks[request.request_id] = prefix.full_chunk

    def draft_bytes(self, request: GenerationRequest) -> int:
        """A spec row's projected bytes in its group's draft-model caches (0: the spec rows' draft holds no KV
        of its own, or projects none): the draft's own layout over the prompt, max_tokens and the draft window,
        which it writes before the rollback as the target does."""
        spec = self.runner.spec
        layout = getattr(spec.draft, "layout", None) if spec is not None else None
        if layout is None:
            return 0
        return layout.row_bytes(len(request.prompt_ids), request.stop.max_tokens + spec.num_draft)

    def cancel(self, request_id: str) -> bool:
        seq = self.scheduler.cancel(request_id)
        if seq is None:
            return False
        if seq.status is SeqStatus.DONE:
            self._end(seq)  # it was still queued; rows and joiners leave at the next step
        return True

    @property
    def active_rows(self) -> int:
        return self.scheduler.active_rows

    @property
    def pending_rows(self) -> int:
        return self.scheduler.pending_rows

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def hold_admission(self, hold: bool) -> None:
        """While held, no queued request joins: the running rows drain (a serial-lane request waits)."""
        self.scheduler.hold_admission = hold

    @property
    def kv_bytes(self) -> int:
        """Bytes the running batch's and the prefill group's caches hold (ghost rows included), and the spec
        rows' target and draft caches."""
        spec = self.runner.spec
        caches = [self.runner.cache, self.runner.joiner_cache]
        if spec is not None:
            caches += [spec.cache, getattr(spec.draft, "cache", None)]
        return sum(cache_nbytes(c) for c in caches if c is not None)

    @property
    def shapes(self) -> set[tuple[int | str, ...]]:
        """The forward shapes run so far (`BatchRunner.shapes`)."""
        return self.runner.shapes

    # ------------------------------------------------------------- the loop

    def step(self) -> bool:
        """One iteration in two phases, each planned by the scheduler once the one before has run (the order
        of mlx-lm's BatchGenerator), run by the runner, its outcome handed back: a decode step for the
        running rows, then admission, token 0 for ready joiners and one prefill chunk."""
        plan = self.scheduler.schedule_decode()
        decoded = self._decode(plan)
        cap = self._pace(len(plan.rows) if decoded else 0) if self.pacer is not None else None
        return self._prefill(self.scheduler.schedule_prefill(cap)) or decoded

    def _pace(self, rows: int) -> int | None:
        """The pacer's cap on this iteration's prefill (None: no rows decode, no cap), once it has seen the gap
        since the last readback of `rows` decoding rows (none: this iteration decoded nothing)."""
        now = self._clock()
        if rows and rows == self._read_rows and not self._joined:
            self.pacer.observe(rows, now - self._read_at, self._prefilled)
        self._read_at, self._read_rows = (now, rows) if rows else (None, 0)
        self._prefilled, self._joined = 0, False
        # the rows decoding next: the running ones and the joiners whose prompts are through (token 0 this phase);
        # the prompts waiting for their first token: the other joiners and the queue
        sched = self.scheduler
        through = sum(s.prefilled >= len(s.prompt_body) for s in sched.joiners)
        decoding = len(sched.running) + through
        waiting = len(sched.joiners) - through + sched.pending_rows
        return self.pacer.cap(decoding, waiting, first_tokens=through > 0) if decoding else None

    def run_until_idle(self, max_steps: int | None = None) -> int:
        steps = 0
        while self.scheduler.has_work and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    # -------------------------------------------------------------- phases

    def _decode(self, plan: DecodePlan) -> bool:
        if plan.evicted:
            self.runner.leave({s.request_id for s in plan.evicted})
            for seq in plan.evicted:
                self._end(seq)
        if not plan.rows:
            return False
        spec = self.runner.spec
        tokens: dict = {}
        if self.runner.num_rows:
            try:
                output = self.runner.decode()
            except Exception as e:  # noqa: BLE001 - a failed forward fails the batch, never the loop
                log.exception("decode step failed; failing %d rows", self.runner.num_rows)
                failed = self.scheduler.fail_running(f"decode step failed: {e!r}")
                self.runner.reset()
                if spec is not None:
                    spec.reset()
                for seq in failed:
                    self._end(seq)
                return True
            self._fail_rows(output.failures)
            tokens = output.tokens
        if spec is not None and spec.num_rows:
            try:
                tokens = {**tokens, **spec.step()}
            except Exception as e:  # noqa: BLE001 - a failed verify forward fails the spec rows only
                log.exception("verify step failed; failing %d spec rows", spec.num_rows)
                failed = [self.scheduler.fail_one(r.request_id, f"verify step failed: {e!r}") for r in spec.rows]
                spec.reset()
                for seq in failed:
                    if seq is not None:
                        self._end(seq)
            tokens = {s.request_id: tokens[s.request_id] for s in self.scheduler.running}
        outcome = self.scheduler.update_decode(tokens)
        caches = {}
        if self.keep_caches:  # each finished row holds its prompt and every token it pushed (a spec row: kept)
            rows = self.runner.extract([s.request_id for s in outcome.finished])
            caches = {s.request_id: self._stored(s, self._held(s), rows[s.request_id]) for s in outcome.finished}
        for em in outcome.emissions:
            self._deliver(em.seq, em.tokens)
        stats = {s.request_id: spec.stats(s.request_id) for s in outcome.finished if s.spec}
        if outcome.finished:
            self.runner.leave({s.request_id for s in outcome.finished})
        for seq in outcome.finished:
            self._end(seq, caches.get(seq.request_id), stats.get(seq.request_id))
        return True

    def _held(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens a finished row's caches hold."""
        if seq.spec:
            return self.runner.spec.held(seq.request_id)
        return seq.request.prompt_ids + tuple(seq.tracker.ids)

    def _prefill(self, plan: PrefillPlan) -> bool:
        if plan.evicted:
            self.runner.leave_group({s.request_id for s in plan.evicted})
            for seq in plan.evicted:
                self._end(seq)
        if plan.is_empty:
            return False
        try:
            if plan.admitted:
                failures = self.runner.add_joiners([self._joiner(s) for s in plan.admitted])
                self._fail_rows(failures)
                plan = plan.without({f.request_id for f in failures})
            if plan.first_tokens:
                self._joined = True
                self._first_tokens(plan.first_tokens)
            if plan.chunks:
                at = self._block_counts(plan.chunks)
                inside = [[p for p in counts if p < len(chunk)] for counts, (_, chunk) in zip(at, plan.chunks)]
                if any(inside):
                    keep_at(self.runner.joiner_cache, inside)
                try:
                    # beside decoding rows MLX's buffer cache stays: emptied, their next step allocates anew
                    self.runner.prefill([chunk for _, chunk in plan.chunks], clear_cache=not self.scheduler.running)
                    self._take_snapshots(plan.chunks, at)
                finally:
                    if self.runner.joiner_cache is not None:
                        unmark(self.runner.joiner_cache)
                self._prefilled += sum(len(chunk) for _, chunk in plan.chunks)
                if self.quantized:
                    for seq, chunk in plan.chunks:
                        self._full_chunks.setdefault(seq.request_id, len(chunk))
                self.scheduler.update_prefill(plan)
        except Exception as e:  # noqa: BLE001 - the joiners' failure is theirs alone
            log.exception("prefill failed; failing %d joiners", len(self.scheduler.joiners))
            failed = self.scheduler.fail_joiners(f"prefill failed: {e!r}")
            self.runner.drop_joiners()
            for seq in failed:
                self._end(seq)
        return True

    def _block_counts(self, chunks) -> list[list[int]]:
        """For each joiner's chunk, the block boundaries inside its prompt body that the chunk passes, as counts
        into it (none inside a fresh prompt's first chunk with quantized KV: no start is served there)."""
        block = self.snapshot_block
        out = []
        for seq, chunk in chunks:
            first = block - seq.prefilled % block if block else 0
            last = min(len(chunk), len(seq.prompt_body) - seq.prefilled - 1)
            counts = list(range(first, last + 1, block)) if block else []
            out.append([p for p in counts if p == len(chunk)] if self.quantized and seq.prefilled == 0 else counts)
        return out

    def _take_snapshots(self, chunks, at: list[list[int]]) -> None:
        """Each joiner's block snapshots at the boundaries its chunk passed (`_block_counts`): from inside the
        forward (`keep_at`), or, at the chunk's end, copies of its caches."""
        for row, ((seq, chunk), counts) in enumerate(zip(chunks, at)):
            for p in counts:
                if p < len(chunk):
                    layers = snapshot_at(self.runner.joiner_cache, row, p, self._snapshot_layers)
                else:
                    layers = snapshot(self.runner.joiner_extract(seq.request_id, self._snapshot_layers), copied=True)
                nbytes = cache_nbytes([c for c in layers if c is not None])
                room = self._room()
                if room is not None and nbytes > room:
                    continue  # the copies are not made
                own([layers])
                self._snapshots.setdefault(seq.request_id, []).append((seq.prefilled + p, layers))
                self._copied[seq.request_id] = self._copied.get(seq.request_id, 0) + nbytes

    def _room(self) -> int | None:
        """The bytes of copies the prompt cache's budget still has room for beside those held (None: no bound)."""
        budget = self.keep_budget() if self.keep_budget is not None else None
        return None if budget is None else budget - sum(self._copied.values())

    def _first_tokens(self, ready: tuple[Sequence, ...]) -> None:
        snapshot = {s.request_id for s in ready if self.keep_boundaries and len(s.prompt_body) > 0}
        output = self.runner.first_tokens([s.request_id for s in ready], snapshot, self._room())
        self._scores.update(output.scores)
        self._fail_rows(output.failures)
        seqs = {s.request_id: s for s in ready}
        for request_id, cache in output.prompts.items():
            seq = seqs[request_id]
            self._boundaries[request_id] = self._stored(seq, seq.prompt_body, cache)
            self._copied[request_id] = self._copied.get(request_id, 0) + cache_nbytes(cache)
        firsts = self.scheduler.update_first_tokens(output.tokens)
        caches = {}
        if self.keep_caches:  # finished at token 0: only the prompt went through
            caches = {
                f.seq.request_id: self._stored(
                    f.seq, f.seq.request.prompt_ids, self.runner.ready_extract(f.seq.request_id)
                )
                for f in firsts
                if not f.joins
            }
        spec = {s.request_id: (s.request.prompt_ids, s.request.stop.max_tokens) for s in ready if s.spec}
        self.runner.join({f.seq.request_id for f in firsts if f.joins}, spec)
        for f in firsts:
            self._deliver(f.seq, f.tokens)
            if not f.joins:
                self._end(f.seq, caches.get(f.seq.request_id))

    def _fail_rows(self, failures: tuple[RowFailure, ...] | list[RowFailure]) -> None:
        """Rows the runner dropped for their own failure end with it; nobody else does."""
        for f in failures:
            log.warning("request %s failed on its own: %s", f.request_id, f.error)
            seq = self.scheduler.fail_one(f.request_id, f.error)
            if seq is not None:
                self._end(seq)

    def _joiner(self, seq: Sequence) -> Joiner:
        sink = self._sinks.get(seq.request_id)
        if sink is not None:
            sink.on_start()
        req = seq.request
        return Joiner(
            req.request_id,
            req.sampling,
            req.prompt_ids,
            self._prefixes.pop(req.request_id, None),
            req.prompt_logprobs,
            spec=seq.spec,
        )

    def _deliver(self, seq: Sequence, tokens: tuple[GeneratedToken, ...]) -> None:
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        for tok in tokens:
            try:
                alive = sink.on_token(tok)
            except Exception as e:  # noqa: BLE001 - the consumer's failure is its own
                self.scheduler.cancel(seq.request_id, FinishReason.ERROR, f"token consumer failed: {e!r}")
                return
            if alive is False:
                self.scheduler.cancel(seq.request_id, FinishReason.CANCELLED, "the consumer went away")
                return

    def _stored(self, seq: Sequence, tokens: tuple[int, ...], cache: list) -> CachedPrefix:
        """An entry for the prompt cache: these caches hold `tokens` of this request."""
        return CachedPrefix(tuple(tokens), cache, full_chunk=self._full_chunks.get(seq.request_id))

    def _end(self, seq: Sequence, cache: CachedPrefix | None = None, spec: SpecStats | None = None) -> None:
        self._prefixes.pop(seq.request_id, None)
        self._full_chunks.pop(seq.request_id, None)
        boundary = self._boundaries.pop(seq.request_id, None)
        self._copied.pop(seq.request_id, None)
        snapshots = tuple(self._snapshots.pop(seq.request_id, ()))
        scores = self._scores.pop(seq.request_id, ())
        if cache is not None and snapshots:
            cache = dataclasses.replace(cache, snapshots=snapshots)
        sink = self._sinks.pop(seq.request_id, None)
        if sink is None:
            return
        result = RequestResult(
            request_id=seq.request_id,
            lane=Lane.CONTINUOUS,
            finish_reason=seq.finish_reason or FinishReason.CANCELLED,
            prompt_tokens=len(seq.request.prompt_ids),
            generated_tokens=seq.generated,
            error=seq.error,
            caches=tuple(c for c in (boundary, cache) if c is not None),
            prompt_logprobs=scores,
            spec=spec,
        )
        try:
            sink.on_end(result)
        except Exception:  # noqa: BLE001
            log.exception("on_end of %s failed", seq.request_id)
