"""The continuous batcher: one loop iteration = scheduler decisions + runner work + delivery.

Containment:
- a request whose consumer fails (its sink raises) or goes away (returns
  False) is removed alone, before the next forward;
- a forward or sampling error in a decode step cannot be pinned on one row:
  every running row fails with the error and the batch caches are dropped;
  the loop goes on serving the queue;
- an error in a joiner's prefill fails that joiner only.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.nn as nn

from engine.batch.kv_budget import KVLayout
from engine.batch.kv_layout import kv_layout
from engine.batch.runner import BatchRunner, LogitsTap
from engine.batch.scheduler import JoinerAction, Scheduler, SchedulerConfig, SeqStatus, Sequence
from engine.generate import KVQuantization
from engine.types import FinishReason, GeneratedToken, GenerationRequest, Lane, RequestResult, TokenSink

log = logging.getLogger(__name__)


class ContinuousBatcher:
    def __init__(
        self,
        model: nn.Module,
        config: SchedulerConfig = SchedulerConfig(),
        tap: Optional[LogitsTap] = None,
        keep_caches: bool = False,
        kv_quantization: Optional[KVQuantization] = None,
    ):
        self.runner = BatchRunner(model, tap, kv_quantization)
        self.scheduler = Scheduler(config)
        self.layout: KVLayout = kv_layout(model, kv_quantization)
        self.keep_caches = keep_caches
        self._sinks: dict[str, TokenSink] = {}

    # ---------------------------------------------------------------- intake

    def submit(self, request: GenerationRequest, sink: TokenSink) -> None:
        """Queue a request (raises RequestTooLarge if it can never fit the KV budget)."""
        if request.request_id in self._sinks:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        kv_bytes = self.layout.row_bytes(len(request.prompt_ids), request.stop.max_tokens)
        self.scheduler.submit(request, kv_bytes)
        self._sinks[request.request_id] = sink

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

    # ------------------------------------------------------------- the loop

    def step(self) -> bool:
        """One iteration: a decode step, then admission and one joiner action."""
        self._drop_cancelled_rows()
        did_decode = self._decode() if self.scheduler.running else False
        return self._advance_joiner() or did_decode

    def run_until_idle(self, max_steps: Optional[int] = None) -> int:
        steps = 0
        while self.scheduler.has_work and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    # -------------------------------------------------------------- helpers

    def _drop_cancelled_rows(self) -> None:
        gone, keep = self.scheduler.cancelled_rows()
        if gone:
            self.runner.filter(keep)
            for seq in gone:
                self._end(seq)

    def _decode(self) -> bool:
        ids = [r.request_id for r in self.runner.rows]
        try:
            tokens = self.runner.decode()
        except Exception as e:  # noqa: BLE001 - a failed forward fails the batch, never the loop
            log.exception("decode step failed; failing %d rows", len(ids))
            failed = self.scheduler.fail_running(f"decode step failed: {e!r}")
            self.runner.reset()
            for seq in failed:
                self._end(seq)
            return True
        outcome = self.scheduler.on_decoded(tokens)
        caches = {}
        if self.keep_caches:
            caches = {s.request_id: self.runner.extract(ids.index(s.request_id)) for s in outcome.finished}
        for em in outcome.emissions:
            self._deliver(em.seq, em.tokens)
        if len(outcome.keep) < len(ids):
            self.runner.filter(outcome.keep)
        for seq in outcome.finished:
            self._end(seq, caches.get(seq.request_id))
        return True

    def _advance_joiner(self) -> bool:
        joiner = self.scheduler.joiner
        if joiner is not None and joiner.finish_reason is not None:  # cancelled while prefilling
            self.scheduler.drop_joiner(joiner.finish_reason)
            self.runner.drop_joiner()
            self._end(joiner)
        work = self.scheduler.joiner_work()
        if work is None:
            return False
        seq = work.seq
        try:
            if work.is_new:
                self.runner.start_joiner(seq.request_id, seq.request.sampling, seq.request.prompt_ids)
            if work.action is JoinerAction.PREFILL:
                self.runner.prefill(work.tokens)
                self.scheduler.on_prefilled(len(work.tokens))
                return True
            token = self.runner.first_token(work.tokens[0])
        except Exception as e:  # noqa: BLE001 - a joiner's failure is its own
            log.exception("prefill of %s failed", seq.request_id)
            self.scheduler.drop_joiner(FinishReason.ERROR, f"prefill failed: {e!r}")
            self.runner.drop_joiner()
            self._end(seq)
            return True
        emitted, joins = self.scheduler.on_first_token(token)
        cache = None
        if joins:
            self.runner.join()
        else:
            if self.keep_caches:
                cache = [c.extract(0) for c in self.runner.joiner_cache]
            self.runner.drop_joiner()
        self._deliver(seq, emitted)
        if not joins:
            self._end(seq, cache)
        return True

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

    def _end(self, seq: Sequence, cache: Optional[list] = None) -> None:
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
            cache=cache,
        )
        try:
            sink.on_end(result)
        except Exception:  # noqa: BLE001
            log.exception("on_end of %s failed", seq.request_id)
