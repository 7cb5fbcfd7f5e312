"""The engine loop: owns the model and the gateway; HTTP handlers reach it only through queues.

It runs on the process's main thread (MLX's compiled functions must not be
first used from a thread that dies before the process exits); uvicorn runs
on a second thread. Handlers put commands (submit, cancel, stop) on the
inbox; the loop applies them between gateway steps and runs steps while there
is work. Each request's `Stream` carries events back to its handler's asyncio
queue through its loop's `Outbox`, which wakes the loop once for every event
posted since its last wake-up (a step's tokens for all rows), not once a
token. A handler whose client went away flips `Stream.alive`: the next
token the engine offers is refused and the row is dropped, even mid-way
through a serial request. The queue of requests not yet started is bounded
(`QueueLimits`): past it a request is refused with `QueueFull`, which the
handler answers with a 503 and a Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from engine.allocator import loaded
from engine.gateway import Gateway, Placement
from engine.request import FinishReason, GeneratedToken, GenerationRequest, RequestResult
from engine.sinks import ForwardingSink

log = logging.getLogger("engine.server")


FAST_GATHER_MS = 2.0  # `engine serve --gather-ms` auto on the fast tier
GATHER_SPAN = 50  # the longest a gathering waits, in quiet gaps (`EngineWorker.gather_s`)
# While the engine works, /stats' snapshot is remade after a step that took a command or ended a request, after every
# step once idle, and else at most this often: made each step, its cache sizes alone (every layer's arrays counted)
# cost a lone qwen27b row ~1% of its step
SNAPSHOT_S = 0.05


class QueueFull(Exception):
    """More requests (or prompt tokens) waiting to start than the server takes."""

    retry_after_s = 1


@dataclass(frozen=True)
class QueueLimits:
    """Requests, and their prompt tokens, that may wait to start at once (None: no limit)."""

    requests: int | None = None
    tokens: int | None = None

    def refusal(self, waiting: int, waiting_tokens: int, tokens: int) -> str | None:
        """Why a request of `tokens` prompt tokens cannot join the queue (None when it can)."""
        if self.requests is not None and waiting >= self.requests:
            return f"{waiting} requests are waiting to start, this server's limit (--max-queued-requests)"
        if self.tokens is not None and waiting and waiting_tokens + tokens > self.tokens:
            return (
                f"{waiting_tokens} prompt tokens are waiting to start and this request's {tokens} would pass "
                f"this server's limit of {self.tokens} (--max-queued-tokens)"
            )
        return None


@dataclass(frozen=True)
class Accepted:
    placement: Placement


@dataclass(frozen=True)
class Rejected:
    error: Exception


@dataclass(frozen=True)
class Token:
    token: GeneratedToken


@dataclass(frozen=True)
class Ended:
    result: RequestResult


Event = Accepted | Rejected | Token | Ended


@dataclass
class Timings:
    """perf_counter stamps of one request's life (seconds)."""

    submitted: float = 0.0
    started: float | None = None
    first_token: float | None = None
    ended: float | None = None

    def as_ms(self) -> dict[str, float | None]:
        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000, 3)

        return {
            "queue": span(self.submitted, self.started),
            "prefill": span(self.started, self.first_token),
            "first_token": span(self.submitted, self.first_token),
            "decode": span(self.first_token, self.ended),
            "total": span(self.submitted, self.ended),
        }


class Outbox:
    """Events from the engine thread to one event loop, handed over in batches.

    Each wake-up of the loop (`call_soon_threadsafe`, a write to its
    self-pipe) drops the GIL, which the engine thread may then wait for while
    the loop's thread runs handlers. The first event posted after a delivery
    schedules the next one; events posted meanwhile ride along, so a decode
    step of many rows wakes the loop once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.closed = False  # the loop is gone: the server is going down
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Event]] = []

    def post(self, events: asyncio.Queue, event: Event) -> bool:
        """Queue `event` for `events` (on the loop); False once the loop is closed."""
        with self._lock:
            if self.closed:
                return False
            wake = not self._pending
            self._pending.append((events, event))
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                with self._lock:
                    self.closed, self._pending = True, []
                return False
        return True

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for events, event in batch:
            events.put_nowait(event)


class Stream:
    """A TokenSink that forwards a request's events to an asyncio queue (through its loop's outbox)."""

    def __init__(self, outbox: Outbox, request_id: str):
        self.outbox = outbox
        self.request_id = request_id
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.alive = True
        self.times = Timings(submitted=time.perf_counter())
        self.max_batch = 0  # rows in the batch at the fullest moment of this request
        self.token_gaps: list[float] = []  # seconds between consecutive tokens (the metrics' inter-token latency)
        self._last = 0.0  # the last token's stamp

    def put(self, event: Event) -> None:
        if not self.outbox.post(self.events, event):
            self.alive = False

    def on_start(self) -> None:
        self.times.started = time.perf_counter()

    def on_token(self, token: GeneratedToken) -> bool | None:
        now = time.perf_counter()
        if self.times.first_token is None:
            self.times.first_token = now
        else:
            self.token_gaps.append(now - self._last)
        self._last = now
        self.put(Token(token))
        return self.alive

    def on_end(self, result: RequestResult) -> None:
        self.times.ended = time.perf_counter()
        self.put(Ended(replace(result, caches=())))  # the caches stay in the engine thread


@dataclass
class Totals:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_rounds: int = 0  # speculative decoding, over all spec-lane requests
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_target_calls: int = 0


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    stream: Stream


@dataclass(frozen=True)
class _Cancel:
    request_id: str
    stop_tokens: int | None = None  # a stop string ended the output after this many tokens


@dataclass(frozen=True)
class _Stop:
    pass


class Arrival:
    """`EngineWorker.arriving`'s mark of one request: `done` once (again: nothing), or at the end of a `with`."""

    def __init__(self, worker: EngineWorker):
        self._worker, self._open = worker, True

    def done(self) -> None:
        if self._open:
            self._open = False
            self._worker._arrived()

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc) -> None:
        self.done()


@dataclass
class EngineWorker:
    """`run()` is the loop (on the thread that owns the device); the other methods are thread-safe."""

    gateway: Gateway
    limits: QueueLimits = QueueLimits()
    metrics: Any = None  # a metrics.Metrics that hears every request's end (None: none)
    warmup: dict[str, Any] = field(default_factory=dict)  # what ran before ready (mode, requests, seconds)
    # Requests reaching an idle engine: more are taken until none came for this long while no other request is on
    # its way (`arriving`; at most GATHER_SPAN times it in all), so a burst whose requests the HTTP thread reads and
    # hands over one by one starts as one prefill group
    gather_s: float = 0.0
    inbox: queue.Queue = field(default_factory=queue.Queue)
    totals: Totals = field(default_factory=Totals)
    snapshot: dict[str, Any] = field(default_factory=dict)
    _live: dict[str, Stream] = field(default_factory=dict)
    _waiting: dict[str, int] = field(default_factory=dict)  # not yet started: prompt tokens, by request id
    _stopped: dict[str, int] = field(default_factory=dict)  # ended by a stop string: the tokens kept
    _outboxes: dict[asyncio.AbstractEventLoop, Outbox] = field(default_factory=dict)
    _arriving: int = 0  # requests the HTTP layer has taken and not yet submitted (`arriving`)
    _snapshot_at: float = 0.0  # when `_refresh` last made the snapshot (perf_counter)
    _ended: bool = False  # a request ended since then
    _arriving_lock: threading.Lock = field(default_factory=threading.Lock)
    _allocator: str = field(default_factory=loaded)  # the host's malloc (`engine serve --allocator`): fixed a process

    def __post_init__(self):
        self._refresh(self.gateway)

    def arriving(self) -> Arrival:
        """A request on its way here (its body read, parsed, tokenized), until `Arrival.done` (after its submit) or
        the end of a `with`: an idle engine's gathering waits for it, however long its quiet gap."""
        with self._arriving_lock:
            self._arriving += 1
        return Arrival(self)

    def _arrived(self) -> None:
        with self._arriving_lock:
            self._arriving -= 1

    def stream(self, request_id: str) -> Stream:
        """A new request's stream, on the running event loop (called from it)."""
        loop = asyncio.get_running_loop()
        outbox = self._outboxes.get(loop)
        if outbox is None or outbox.closed:
            outbox = self._outboxes[loop] = Outbox(loop)
        return Stream(outbox, request_id)

    def submit(self, request: GenerationRequest, stream: Stream) -> None:
        self.inbox.put(_Submit(request, stream))

    def cancel(self, request_id: str, stop_tokens: int | None = None) -> None:
        """Drop the request's row; `stop_tokens`: a stop string ended its output after that many tokens, so
        its end is recorded as a stop of that length."""
        self.inbox.put(_Cancel(request_id, stop_tokens))

    def stop(self) -> None:
        """Ask the loop to cancel what is running and return."""
        self.inbox.put(_Stop())

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        gateway = self.gateway
        while True:
            idle = not gateway.has_work
            commands = self._drain(block=idle)
            if idle and self.gather_s > 0 and any(isinstance(c, _Submit) for c in commands):
                commands += self._gather()
            for cmd in commands:
                if isinstance(cmd, _Stop):
                    self._shutdown(gateway)
                    return
                self._apply(gateway, cmd)
            if gateway.has_work:
                try:
                    gateway.step()
                except Exception:  # noqa: BLE001 - the lanes contain their own failures; this is a last guard
                    log.exception("engine step failed")
            self._track_rows(gateway)
            if commands or self._ended or not gateway.has_work or time.perf_counter() - self._snapshot_at >= SNAPSHOT_S:
                self._refresh(gateway)

    def _drain(self, block: bool) -> list:
        out = []
        try:
            out.append(self.inbox.get(timeout=0.25) if block else self.inbox.get_nowait())
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            return out

    def _gather(self) -> list:
        """The commands that come until none came for `gather_s` while no request is `arriving` (at most GATHER_SPAN
        times it in all)."""
        out, end = [], time.perf_counter() + GATHER_SPAN * self.gather_s
        while (left := end - time.perf_counter()) > 0:
            try:
                out.append(self.inbox.get(timeout=min(self.gather_s, left)))
            except queue.Empty:
                if not self._arriving:
                    break
        return out

    def _apply(self, gateway: Gateway, cmd) -> None:
        if isinstance(cmd, _Cancel):
            if cmd.stop_tokens is not None and cmd.request_id in self._live:
                self._stopped[cmd.request_id] = cmd.stop_tokens
            gateway.cancel(cmd.request_id)
            return
        stream, request = cmd.stream, cmd.request
        self.totals.requests += 1
        if not stream.alive:  # the client left before the engine saw the request
            self.totals.cancelled += 1
            return
        tokens = len(request.prompt_ids)
        full = self.limits.refusal(len(self._waiting), sum(self._waiting.values()), tokens)
        if full is not None:
            self.totals.rejected += 1
            stream.put(Rejected(QueueFull(full)))
            return
        try:
            placement = gateway.submit(request, _Tracked(stream, self))
        except Exception as e:  # noqa: BLE001 - e.g. RequestTooLarge: the handler turns it into a 4xx
            self.totals.rejected += 1
            stream.put(Rejected(e))
            return
        self._live[request.request_id] = stream
        self._waiting[request.request_id] = tokens
        self.totals.prompt_tokens += len(request.prompt_ids)
        self.totals.cached_tokens += placement.cached_tokens
        stream.put(Accepted(placement))

    def record_start(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def record_end(self, result: RequestResult, stream: Stream | None = None) -> RequestResult:
        """Count the request's end; returns its result as recorded (a stop string's end is a stop of the
        tokens the output kept, however many more the engine made before the cancel reached it)."""
        self._live.pop(result.request_id, None)
        self._waiting.pop(result.request_id, None)
        kept = self._stopped.pop(result.request_id, None)
        if kept is not None and result.finish_reason is FinishReason.CANCELLED:
            result = replace(result, finish_reason=FinishReason.STOP, generated_tokens=kept)
        self.totals.completion_tokens += result.generated_tokens
        if result.spec is not None:
            self.totals.spec_rounds += result.spec.rounds
            self.totals.spec_drafted += result.spec.drafted
            self.totals.spec_accepted += result.spec.accepted
            self.totals.spec_target_calls += result.spec.target_calls
        if result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.totals.completed += 1
        elif result.finish_reason is FinishReason.CANCELLED:
            self.totals.cancelled += 1
        else:
            self.totals.errors += 1
        if self.metrics is not None and stream is not None:
            self.metrics.observe_end(result, stream.times, stream.token_gaps)
        # published now, before the end reaches the client (the next refresh comes after the step): a client
        # that reads /metrics or /stats as its response ends finds the request counted
        self.snapshot = {**self.snapshot, "totals": vars(self.totals).copy()}
        self._ended = True
        return result

    def _track_rows(self, gateway: Gateway) -> None:
        """Each live request's most rows decoding beside it (its log line's batch), after every step."""
        rows = gateway.active_rows or 1
        for stream in self._live.values():
            if stream.max_batch < rows:
                stream.max_batch = rows

    def _refresh(self, gateway: Gateway) -> None:
        """The snapshot /stats and /metrics read (`SNAPSHOT_S`)."""
        self._snapshot_at, self._ended = time.perf_counter(), False
        rows = gateway.active_rows
        batcher = gateway.batcher
        kv_bytes = batcher.kv_bytes if batcher is not None else 0
        pc = gateway.prompt_cache
        seen, builds = len(gateway.shapes), gateway.builds.count()
        self.snapshot = {
            "batch": {
                "max_rows": gateway.config.batch,
                "mode": "continuous" if batcher is not None else "serial",
                "active_rows": rows,
                "pending_rows": gateway.pending_rows,
                "live_requests": len(self._live),
                "waiting_requests": len(self._waiting),
                "waiting_tokens": sum(self._waiting.values()),
                "kv_bytes": kv_bytes,
                "kv_budget_bytes": gateway.config.kv_budget,
                # prompt tokens all prefilling requests take a step, beside decoding rows and with none (None: a
                # chunk each)
                "prefill_budget": gateway.config.prefill_budget,
                "idle_prefill_budget": gateway.config.idle_prefill_budget,
                # prefill pacing beside decoding rows (`--prefill-itl`): its ratio and what it has measured
                "prefill_pacing": batcher.pacer.as_record() if batcher is not None and batcher.pacer else None,
                "gather_ms": self.gather_s * 1e3,  # `--gather-ms`: how long an idle engine gathers a burst
            },
            "prompt_cache": None if pc is None else vars(pc.stats()),
            "totals": vars(self.totals).copy(),
            "warmup": self.warmup,
            # forward shapes first run after ready: on CUDA each compiled kernels while requests waited; kernel
            # builds: the engine's CUDA kernels compiled in this process (with none, each shape reused them)
            "shapes": {
                "seen": seen,
                "new_since_ready": seen - gateway.shapes_at_ready,
                "decode_buckets": list(gateway.config.decode_buckets),
                "kernel_builds": builds,
                "kernel_builds_since_ready": builds - gateway.kernel_builds_at_ready,
            },
            "kernel_cache": cache.stats() if (cache := gateway.builds.cache) else None,
            # MLX's memory: arrays alive, the most alive at once since start, freed buffers kept for reuse
            "memory": {
                "active_bytes": mx.get_active_memory(),
                "peak_bytes": mx.get_peak_memory(),
                "cache_bytes": mx.get_cache_memory(),
                "host_allocator": self._allocator,  # mimalloc or system: what `--allocator` got
            },
        }

    def _shutdown(self, gateway: Gateway) -> None:
        for request_id in list(self._live):
            gateway.cancel(request_id)
        for stream in self._live.values():
            stream.alive = False
        while gateway.has_work:  # cancelled rows leave at the next step
            gateway.step()


class _Tracked(ForwardingSink):
    """The stream as the gateway sees it, with the worker's bookkeeping on the way out."""

    def __init__(self, stream: Stream, worker: EngineWorker):
        super().__init__(stream)
        self.worker = worker

    def on_start(self) -> None:
        self.inner.max_batch = max(self.inner.max_batch, 1)  # a serial or spec request runs within one step
        self.worker.record_start(self.inner.request_id)
        super().on_start()

    def on_end(self, result: RequestResult) -> None:
        super().on_end(self.worker.record_end(result, self.inner))
