"""The gateway: places each request on a lane and drives both lanes from one loop.

    serial      the strict B=1 path (engine.generate), alone on the device;
                `--batch 1` pins every request here (the determinism mode)
    continuous  the continuous-batching scheduler, up to `batch` rows

`batch` is a concurrency cap, not a mode. A composition the scheduler does
not implement runs serial, unchanged (never downgraded to make it batch),
and every result says which lane it ran on and, at placement, why.

While a serial request waits, admission to the batch is held; the running
rows finish, the serial request runs alone, then admission resumes (drain,
never starve).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

import mlx.nn as nn

from engine.batch.batcher import ContinuousBatcher
from engine.batch.runner import can_batch
from engine.batch.scheduler import SchedulerConfig
from engine.generate import DEFAULT_PREFILL_STEP, KVQuantization, generate
from engine.types import FinishReason, GenerationRequest, Lane, RequestResult, TokenSink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    batch: int = 8  # concurrency cap; 1 = strict serial
    prefill_chunk: int = DEFAULT_PREFILL_STEP
    prefill_batch: int = 8  # prompts prefilled together on the continuous lane
    kv_budget_bytes: Optional[int] = None
    kv_quantization: Optional[KVQuantization] = None

    def __post_init__(self):
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")


@dataclass(frozen=True)
class Placement:
    lane: Lane
    reason: str


class Gateway:
    def __init__(self, model: nn.Module, config: GatewayConfig = GatewayConfig()):
        self.model = model
        self.config = config
        self.batchable = can_batch(model)
        if config.kv_quantization is not None:
            config.kv_quantization.check(model.make_cache())  # refuses sliding-window models up front
        self.batcher: Optional[ContinuousBatcher] = None
        if config.batch > 1 and self.batchable and self._kv_batches:
            self.batcher = ContinuousBatcher(
                model,
                SchedulerConfig(
                    max_rows=config.batch,
                    prefill_chunk=config.prefill_chunk,
                    prefill_batch=config.prefill_batch,
                    kv_budget_bytes=config.kv_budget_bytes,
                ),
                kv_quantization=config.kv_quantization,
            )
        self._serial: deque[tuple[GenerationRequest, TokenSink]] = deque()
        self._cancelled: set[str] = set()

    @property
    def _kv_batches(self) -> bool:
        kv = self.config.kv_quantization
        return kv is None or kv.start == 0

    def place(self, request: GenerationRequest) -> Placement:
        if self.config.batch == 1:
            return Placement(Lane.SERIAL, "--batch 1 pins the strict serial path")
        if not self.batchable:
            kinds = sorted({type(c).__name__ for c in self.model.make_cache()})
            return Placement(Lane.SERIAL, f"this model's caches ({', '.join(kinds)}) have no batched form")
        if not self._kv_batches:
            return Placement(
                Lane.SERIAL,
                f"quantized KV starting after {self.config.kv_quantization.start} tokens runs serial "
                "(the batch lane quantizes from the first token only)",
            )
        return Placement(Lane.CONTINUOUS, f"continuous batching, up to {self.config.batch} rows")

    def submit(self, request: GenerationRequest, sink: TokenSink) -> Placement:
        placement = self.place(request)
        if placement.lane is Lane.CONTINUOUS:
            self.batcher.submit(request, sink)
        else:
            self._serial.append((request, sink))
        return placement

    def cancel(self, request_id: str) -> bool:
        for i, (req, sink) in enumerate(self._serial):
            if req.request_id == request_id:
                del self._serial[i]
                sink.on_end(RequestResult(request_id, Lane.SERIAL, FinishReason.CANCELLED, len(req.prompt_ids), 0))
                return True
        if self.batcher is not None and self.batcher.cancel(request_id):
            return True
        self._cancelled.add(request_id)  # a serial request running right now stops at its next token
        return False

    @property
    def has_work(self) -> bool:
        return bool(self._serial) or (self.batcher is not None and self.batcher.has_work)

    @property
    def active_rows(self) -> int:
        return self.batcher.active_rows if self.batcher else 0

    @property
    def pending_rows(self) -> int:
        return len(self._serial) + (self.batcher.pending_rows if self.batcher else 0)

    def step(self) -> bool:
        batcher = self.batcher
        if self._serial:
            if batcher is not None:
                batcher.scheduler.hold_admission = True
                if batcher.active_rows:
                    return batcher.step()  # drain the batch first
            self._run_serial(*self._serial.popleft())
            if batcher is not None and not self._serial:
                batcher.scheduler.hold_admission = False
            return True
        if batcher is not None:
            batcher.scheduler.hold_admission = False
            return batcher.step()
        return False

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    def _run_serial(self, request: GenerationRequest, sink: TokenSink) -> None:
        generated, reason, error = 0, FinishReason.CANCELLED, None
        try:
            for tok in generate(
                self.model,
                request.prompt_ids,
                sampling=request.sampling,
                stop=request.stop,
                prefill_step_size=self.config.prefill_chunk,
                kv_quantization=self.config.kv_quantization,
            ):
                generated += 1
                if tok.finish_reason is not None:
                    reason = tok.finish_reason
                if sink.on_token(tok) is False or request.request_id in self._cancelled:
                    reason = FinishReason.CANCELLED
                    break
        except Exception as e:  # noqa: BLE001 - one request's failure, not the loop's
            log.exception("serial request %s failed", request.request_id)
            reason, error = FinishReason.ERROR, repr(e)
        self._cancelled.discard(request.request_id)
        sink.on_end(RequestResult(request.request_id, Lane.SERIAL, reason, len(request.prompt_ids), generated, error))
