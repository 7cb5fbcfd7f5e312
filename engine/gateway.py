"""The gateway: places each request on a lane and drives both lanes from one loop.

    serial      the strict B=1 path (engine.generate), alone on the device;
                `--batch 1` pins every request here (the determinism mode)
    continuous  the continuous-batching scheduler, up to `batch` rows
    spec        speculative decoding (when the server has a draft source),
                alone on the device like the serial lane

`batch` is a concurrency cap, not a mode. A composition the scheduler does
not implement runs serial, unchanged (never downgraded to make it batch),
and every result says which lane it ran on and, at placement, why.

While a serial request waits, admission to the batch is held; the running
rows finish, the serial request runs alone, then admission resumes (drain,
never starve).

With a prompt cache, each request starts from the longest reusable prefix
stored by earlier requests (both lanes), and each request that finishes
normally stores its caches (extracted from the batch on the continuous lane),
with block snapshots of the layers that cannot rewind (`prompt_cache_block`).
On the spec lane the target starts from a hit too and stores its prompt's
boundary (a draft model prefills the prompt itself). The MTP head has to see
the target's hidden state at every prompt position, so its requests store
the head's state with the boundary and start only from entries that hold it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.nn as nn

from engine.batch.batcher import ContinuousBatcher
from engine.batch.kv_layout import kv_layout
from engine.batch.pacing import PacingConfig
from engine.batch.runner import can_batch, chunk_buckets, power_buckets
from engine.batch.scheduler import SchedulerConfig, check_budget
from engine.batch.spec_rows import SpecRows
from engine.cache import KVCache, RecurrentCache
from engine.cache.prompt_cache import PromptCache
from engine.generate import DEFAULT_PREFILL_STEP, BlockSnapshots, KVQuantization, generate
from engine.kernels import FAST, on_cuda
from engine.kernels.cuda_source import BUILDS, KernelBuilds
from engine.prompt_logprobs import PromptScorer
from engine.request import CachedPrefix, FinishReason, GenerationRequest, Lane, RequestResult, SpecStats
from engine.sinks import ForwardingSink, TokenSink
from engine.speculative.config import Speculation

log = logging.getLogger(__name__)

CUDA_BATCH, OTHER_BATCH = 64, 8  # the default --batch: on CUDA the fast tier's kernels take up to 64 rows
# the default --prefill-batch: on the fast tier a burst's prompts share fewer, larger prefill forwards (each reads
# the weights once); elsewhere mlx_lm.server's 8, which the same-B parity gates replay
FAST_PREFILL_BATCH = 32
# The fast tier's prefill pacing (`engine.batch.pacing`): with rows decoding (and no more prompts waiting than
# them), the gap between two of a row's tokens with a prefill in it is at most this many decode steps.
FAST_PREFILL_ITL = 3.0
# The fast tier's prefill budget while no row decodes, as a multiple of its budget: a qwen27b prefill forward on
# the H200 has a fixed cost of ~100 ms, and the rate grows with its tokens to ~4K (32x64: 6,515 prompt tok/s,
# 32x128: 7,813), so an idle burst of 32 128-token prompts is one forward, not two.
IDLE_BUDGET_FACTOR = 2


# the caches spec rows roll back per row (`BatchKVCache.trim_rows`, `RecurrentCache.keep_traced_rows`)
SPEC_ROW_CACHES = frozenset({KVCache, RecurrentCache})


def default_batch() -> int:
    return CUDA_BATCH if on_cuda() else OTHER_BATCH


@dataclass(frozen=True)
class GatewayConfig:
    batch: int = 8  # concurrency cap; 1 = strict serial
    prefill_chunk: int = DEFAULT_PREFILL_STEP
    prefill_batch: int = 8  # prompts prefilled together on the continuous lane
    kv_budget: int | None = None  # --kv-budget, in bytes
    kv_quantization: KVQuantization | None = None
    prompt_cache_bytes: int = 0  # 0: no prompt cache
    prompt_cache_block: int = 256  # block snapshots of caches that cannot rewind, every this many tokens; 0: none
    decode_buckets: tuple[int, ...] = ()  # the continuous lane's decode row counts (`BatchRunner`); (): any
    prefill_buckets: tuple[int, ...] = ()  # its prefill chunk lengths, padded up to one of them; (): any
    prefill_groups: tuple[int, ...] = ()  # its prefill group sizes, filled with ghost joiners up to one; (): any
    prefill_budget: int | None = None  # its prompt tokens an iteration, all joiners (SchedulerConfig)
    idle_prefill_budget: int | None = None  # the same while no row decodes (SchedulerConfig)
    prefill_itl: float | None = None  # prefill pacing's ratio beside decoding rows (`PacingConfig`); None: none
    spec_batch: bool = False  # speculation runs as spec rows in the continuous batch where it can (`--spec-batch`)

    def __post_init__(self):
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if (self.decode_buckets or self.prefill_groups) and self.kv_quantization is not None:
            raise ValueError("decode and prefill group buckets do not combine with quantized KV (--kv-bits)")
        if self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0, got {self.prompt_cache_bytes}")
        if self.prompt_cache_block < 0:
            raise ValueError(f"prompt_cache_block must be >= 0, got {self.prompt_cache_block}")

    def scheduler(self) -> SchedulerConfig:
        """The continuous lane's scheduler settings."""
        return SchedulerConfig(
            max_rows=self.batch,
            prefill_chunk=self.prefill_chunk,
            prefill_batch=self.prefill_batch,
            kv_budget_bytes=self.kv_budget,
            prefill_budget=self.prefill_budget,
            idle_prefill_budget=self.idle_prefill_budget,
            chunk_buckets=self.prefill_buckets,
        )

    @classmethod
    def for_tier(
        cls,
        tier: str | None = None,
        *,
        batch: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_STEP,
        prefill_batch: int | None = None,
        kv_budget: int | None = None,
        kv_quantization: KVQuantization | None = None,
        prompt_cache_bytes: int = 0,
        prompt_cache_block: int = 256,
        decode_buckets: tuple[int, ...] | None = None,
        prefill_buckets: tuple[int, ...] | None = None,
        prefill_groups: tuple[int, ...] | None = None,
        prefill_budget: int | None = None,
        idle_prefill_budget: int | None = None,
        prefill_itl: float | None = None,
        spec_batch: bool = False,
    ) -> GatewayConfig:
        """The settings with each None (auto) resolved for `tier`, the kernel tier that loaded (None: not yet
        known): the batch cap `default_batch`; the fast tier pads decode rows and prefill groups to
        power_buckets and prefill chunks to chunk_buckets, prefills up to FAST_PREFILL_BATCH prompts together,
        and its joiners share one chunk's tokens an iteration, paced beside decoding rows (FAST_PREFILL_ITL; not
        with quantized KV), IDLE_BUDGET_FACTOR times that while no row decodes; the exact tier does none of it (it
        stays bit-exact with mlx-lm's BatchGenerator, which pads neither and gives each joiner a whole chunk). A
        prefill budget, idle budget or pacing ratio of 0 is none."""
        fast = tier == FAST
        batch = batch or default_batch()
        pads = fast and kv_quantization is None and batch > 1
        if decode_buckets is None:
            decode_buckets = power_buckets(batch) if pads else ()
        prefill_batch = prefill_batch or (FAST_PREFILL_BATCH if fast else cls.prefill_batch)
        if prefill_groups is None:
            prefill_groups = power_buckets(prefill_batch) if pads else ()
        if prefill_buckets is None:
            prefill_buckets = chunk_buckets(prefill_chunk) if fast else ()
        if prefill_budget is None:
            prefill_budget = prefill_chunk if fast else 0
        if idle_prefill_budget is None:
            idle_prefill_budget = IDLE_BUDGET_FACTOR * prefill_budget if fast else 0
        if prefill_itl is None:  # not with quantized KV: a prompt's first chunk, the one that attends to
            # full-precision keys (mlx-lm's scheme), would be a paced piece
            prefill_itl = FAST_PREFILL_ITL if fast and kv_quantization is None else 0
        return cls(
            batch=batch,
            prefill_chunk=prefill_chunk,
            prefill_batch=prefill_batch,
            kv_budget=kv_budget,
            kv_quantization=kv_quantization,
            prompt_cache_bytes=prompt_cache_bytes,
            prompt_cache_block=prompt_cache_block,
            decode_buckets=tuple(decode_buckets),
            prefill_buckets=tuple(prefill_buckets),
            prefill_groups=tuple(prefill_groups),
            prefill_budget=prefill_budget or None,
            idle_prefill_budget=idle_prefill_budget or None,
            prefill_itl=prefill_itl or None,
            spec_batch=spec_batch,
        )


@dataclass(frozen=True)
class Placement:
    lane: Lane
    reason: str
    cached_tokens: int = 0  # prompt tokens served by the prompt cache
    spec: bool = False  # on the continuous lane, as a spec row


@dataclass(frozen=True)
class _Queued:
    request: GenerationRequest
    sink: TokenSink
    prefix: CachedPrefix | None
    lane: Lane = Lane.SERIAL


class _StoringSink(ForwardingSink):
    """Stores a normally finished request's caches in the prompt cache.

    The caller's sink gets the result without them: a consumer that keeps
    results must not keep caches alive that the byte budget no longer counts.
    """

    def __init__(self, inner: TokenSink, store: PromptCache):
        super().__init__(inner)
        self.store = store

    def on_end(self, result: RequestResult) -> None:
        if result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            for prefix in result.caches:
                self.store.insert(prefix)
        self.inner.on_end(dataclasses.replace(result, caches=()))


def _keeps_boundary(
    request: GenerationRequest, kept: list[CachedPrefix], full_chunk: int | None = None
) -> Callable[..., None] | None:
    """What keeps a copy of the caches at the prompt's boundary (all but its last token) in `kept`, with the
    draft source's state there where the speculative lane hands one over; None for a one-token prompt, which
    has no such boundary."""
    if len(request.prompt_ids) < 2:
        return None
    return lambda cache, draft=None: kept.append(
        CachedPrefix(request.prompt_ids[:-1], copy.deepcopy(cache), draft=draft, full_chunk=full_chunk)
    )


class Gateway:
    def __init__(
        self,
        model: nn.Module,
        config: GatewayConfig = GatewayConfig(),
        speculation: Speculation | None = None,
        builds: KernelBuilds = BUILDS,
    ):
        self.model = model
        self.builds = builds  # the model's kernel builds and their cache (`KernelSet.builds`)
        self.config = config
        self.speculation = speculation
        self.batchable = can_batch(model)
        if config.kv_quantization is not None:
            config.kv_quantization.check(model.make_cache())  # refuses sliding-window models up front
        self.layout = kv_layout(model, config.kv_quantization)
        continuous = config.batch > 1 and self.batchable and self._kv_batches
        # Quantized KV switching on past the first tokens (mlx-lm's quantized_kv_start) has no prompt cache.
        self.prompt_cache: PromptCache | None = None
        if config.prompt_cache_bytes > 0 and self._kv_batches:
            self.prompt_cache = PromptCache(config.prompt_cache_bytes, full_chunk=self._full_chunk(continuous))
        self.batcher: ContinuousBatcher | None = None
        if continuous:
            self.batcher = ContinuousBatcher(
                model,
                config.scheduler(),
                kv_quantization=config.kv_quantization,
                keep_caches=self.prompt_cache is not None,
                keep_budget=self.prompt_cache.copy_budget if self.prompt_cache is not None else None,
                snapshot_block=config.prompt_cache_block,
                decode_buckets=config.decode_buckets,
                chunk_buckets=config.prefill_buckets,
                group_buckets=config.prefill_groups,
                layout=self.layout,
                spec=self._spec_rows(),
                pacing=PacingConfig(config.prefill_itl) if config.prefill_itl else None,
            )
        self._serial: deque[_Queued] = deque()
        self._cancelled: set[str] = set()
        self._serial_shapes: set[tuple[int | str, ...]] = set()
        self.shapes_at_ready = 0  # how many of `shapes` the warm-up ran (`mark_ready`)
        self.kernel_builds_at_ready = 0  # how many custom-kernel builds the process had asked for by then

    def _spec_rows(self) -> SpecRows | None:
        """The continuous lane's spec rows, with --spec-batch and a draft source they can run (`_spec_batch_refusal`)."""
        spec = self.speculation
        if spec is None or not self.config.spec_batch or self._spec_batch_refusal() is not None:
            return None
        return SpecRows(self.model, spec.source, spec.config.kind, spec.config.num_draft, spec.config.policy)

    def _spec_batch_refusal(self) -> str | None:
        """Why speculation cannot run as spec rows in the continuous batch (None: it can)."""
        models = {"this model's": self.model, "the draft model's": self.speculation.draft}
        for whose, model in models.items():
            kinds = {type(c) for c in model.make_cache()} if model is not None else set()
            if not kinds <= SPEC_ROW_CACHES:
                names = ", ".join(sorted(k.__name__ for k in kinds - SPEC_ROW_CACHES))
                return f"{whose} caches ({names}) cannot roll back rows in the continuous batch"
        return None

    @property
    def _kv_batches(self) -> bool:
        kv = self.config.kv_quantization
        return kv is None or kv.start == 0

    def _full_chunk(self, continuous: bool) -> int | None:
        """With quantized KV, the first prefill chunk of a prompt alone on its lane (at most this long; the
        prompt cache's starts begin past it): the chunk, or the continuous lane's prefill budget if smaller
        (block snapshots never cut it). None without quantized KV."""
        cfg = self.config
        if cfg.kv_quantization is None:
            return None
        return min(cfg.prefill_chunk, cfg.prefill_budget or cfg.prefill_chunk) if continuous else cfg.prefill_chunk

    def place(self, request: GenerationRequest) -> Placement:
        placement = self._place_plain()
        spec = self.speculation
        if spec is None:
            return placement
        refusal = spec.refusal(request.sampling)
        if refusal is None and request.prompt_logprobs is not None:
            refusal = "a scored prompt (echo with logprobs) runs without speculation"
        if refusal is None and self.config.kv_quantization is not None:
            refusal = "quantized KV runs without speculation"
        if refusal is not None:
            return Placement(placement.lane, f"{refusal}; {placement.reason}")
        c = spec.config
        if self.config.spec_batch and placement.lane is Lane.CONTINUOUS:
            why = self._spec_batch_refusal()
            if why is None:
                return Placement(
                    Lane.CONTINUOUS,
                    f"speculative decoding ({c.kind}, up to {c.num_draft} drafts per round, {c.policy}, trace rollback) "
                    f"in the continuous batch, up to {self.config.batch} rows",
                    spec=True,
                )
            return Placement(
                Lane.SPEC,
                f"speculative decoding ({c.kind}, up to {c.num_draft} drafts per round, {c.policy}), alone on the "
                f"device: {why}",
            )
        return Placement(
            Lane.SPEC,
            f"speculative decoding ({spec.config.kind}, up to {spec.config.num_draft} "
            f"drafts per round, {spec.config.policy}), alone on the device",
        )

    def _place_plain(self) -> Placement:
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

    def kv_need(self, request: GenerationRequest, placement: Placement) -> tuple[int, int]:
        """The target's KV bytes `request` projects where `placement` puts it, and its draft model's caches' (a
        spec row's verify window writes up to num_draft columns past its tokens; a draft model keeps caches of
        its own for every spec row)."""
        if not placement.spec:
            return self.layout.row_bytes(len(request.prompt_ids), request.stop.max_tokens), 0
        extra = self.speculation.config.num_draft
        return (
            self.layout.row_bytes(len(request.prompt_ids), request.stop.max_tokens + extra),
            self.batcher.draft_bytes(request),
        )

    def submit(self, request: GenerationRequest, sink: TokenSink) -> Placement:
        """Queue a request. Raises RequestTooLarge when it can never fit the KV budget."""
        placement = self.place(request)
        need, draft = self.kv_need(request, placement)
        check_budget(request, need + draft, self.config.kv_budget, draft)  # before the prompt cache is asked
        prefix = None
        if self.prompt_cache is not None:
            state = self.speculation.prefix_state if placement.lane is Lane.SPEC else None
            if request.prompt_logprobs is None:  # a scored prompt needs the logits of every position: cold
                prefix = self.prompt_cache.lookup(request.prompt_ids, draft=state)
            sink = _StoringSink(sink, self.prompt_cache)
        cached = len(prefix.tokens) if prefix else 0
        if placement.lane is Lane.CONTINUOUS:
            self.batcher.submit(request, sink, prefix, need, spec=placement.spec)
        else:
            self._serial.append(_Queued(request, sink, prefix, placement.lane))
        return dataclasses.replace(placement, cached_tokens=cached)

    def cancel(self, request_id: str) -> bool:
        for i, queued in enumerate(self._serial):
            if queued.request.request_id == request_id:
                del self._serial[i]
                n = len(queued.request.prompt_ids)
                queued.sink.on_end(RequestResult(request_id, queued.lane, FinishReason.CANCELLED, n, 0))
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
                batcher.hold_admission(True)
                if batcher.active_rows:
                    return batcher.step()  # drain the batch first
            self._run_serial(self._serial.popleft())
            if batcher is not None and not self._serial:
                batcher.hold_admission(False)
            return True
        if batcher is not None:
            batcher.hold_admission(False)
            return batcher.step()
        return False

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    def close(self) -> int:
        """At shutdown: the prompt cache's entries to its disk tier, if it has one; how many were written."""
        return self.prompt_cache.flush() if self.prompt_cache is not None else 0

    @property
    def shapes(self) -> set[tuple[int | str, ...]]:
        """The forward shapes run so far, both lanes (serial: the prompt tokens a request prefilled)."""
        return self._serial_shapes | (self.batcher.shapes if self.batcher else set())

    def mark_ready(self) -> None:
        """The shapes so far are the warm-up's: shapes past `shapes_at_ready` were first run after ready (on
        CUDA each compiled kernels while requests waited), and so are the custom-kernel builds so far."""
        self.shapes_at_ready = len(self.shapes)
        self.kernel_builds_at_ready = self.builds.count()

    def _run_serial(self, queued: _Queued) -> None:
        """Run one request alone on the device: the strict B=1 path, or speculation on the spec lane."""
        request, sink = queued.request, queued.sink
        generated, reason, error = 0, FinishReason.CANCELLED, None
        fed: list[int] = []
        kept: list[CachedPrefix] = []
        snapshots: list[tuple[int, list]] = []
        stats: SpecStats | None = None
        cache = None
        scorer = PromptScorer(request.prompt_ids, request.prompt_logprobs or 0)
        sink.on_start()
        try:
            if queued.lane is Lane.SPEC:
                stats = self.speculation.new_stats()
                tokens = self._spec_tokens(queued, stats, kept)
            else:
                cache, tokens = self._plain_tokens(queued, fed, kept, snapshots, scorer)
            for tok in tokens:
                generated += 1
                if tok.finish_reason is not None:
                    reason = tok.finish_reason
                if sink.on_token(tok) is False or request.request_id in self._cancelled:
                    reason = FinishReason.CANCELLED
                    break
        except Exception as e:  # noqa: BLE001 - one request's failure, not the loop's
            log.exception("%s request %s failed", queued.lane.value, request.request_id)
            reason, error = FinishReason.ERROR, repr(e)
        self._cancelled.discard(request.request_id)
        if self.prompt_cache is not None and cache is not None:
            kept.append(
                CachedPrefix(
                    request.prompt_ids + tuple(fed), cache, tuple(snapshots), full_chunk=self._serial_full_chunk(queued)
                )
            )
        n = len(request.prompt_ids)
        scored = scorer.result() if request.prompt_logprobs is not None and reason is not FinishReason.ERROR else ()
        sink.on_end(
            RequestResult(request.request_id, queued.lane, reason, n, generated, error, tuple(kept), stats, scored)
        )

    def _spec_tokens(self, queued: _Queued, stats: SpecStats, kept: list[CachedPrefix]):
        """Speculative generation, the target (and the MTP head) starting from the request's cached prefix if it
        has one; with a prompt cache, the target's caches at the prompt's boundary are kept, with the MTP head's
        state there (the caches after the rounds hold what the rollback left, so only the prompt is stored)."""
        request, prefix = queued.request, queued.prefix
        on_prompt = _keeps_boundary(request, kept) if self.prompt_cache is not None else None
        return self.speculation.generate(
            request.prompt_ids,
            request.sampling,
            request.stop,
            stats,
            cache=prefix.cache if prefix else None,
            cached_tokens=len(prefix.tokens) if prefix else 0,
            on_prompt=on_prompt,
            source_state=prefix.draft if prefix else None,
        )

    def _serial_full_chunk(self, queued: _Queued) -> int | None:
        """With quantized KV, the first chunk this request's caches were made with: its prefix's, or its own
        first prefill chunk."""
        if queued.prefix is not None:
            return queued.prefix.full_chunk
        full = self.prompt_cache.full_chunk if self.prompt_cache is not None else None
        return None if full is None else min(full, len(queued.request.prompt_ids) - 1)

    def _plain_tokens(
        self,
        queued: _Queued,
        fed: list[int],
        kept: list[CachedPrefix],
        snapshots: list[tuple[int, list]],
        scorer: PromptScorer,
    ):
        """The strict B=1 generation, starting from the request's cached prefix if it has one (`scorer` fed
        the prefill's logits where the request scores its prompt)."""
        request, prefix = queued.request, queued.prefix
        cache = prefix.cache if prefix else self.model.make_cache()
        self._serial_shapes.add(("serial", len(request.prompt_ids) - (len(prefix.tokens) if prefix else 0)))
        on_prompt, blocks = None, None
        if self.prompt_cache is not None and not all(c.is_trimmable() for c in cache):
            # caches that cannot rewind: keep the prompt's boundary too
            on_prompt = _keeps_boundary(request, kept, self._serial_full_chunk(queued))
            if self.config.prompt_cache_block:  # and the block boundaries on the way
                blocks = BlockSnapshots(self.config.prompt_cache_block, lambda n, layers: snapshots.append((n, layers)))

        tokens = generate(
            self.model,
            request.prompt_ids,
            sampling=request.sampling,
            stop=request.stop,
            cache=cache,
            prefill_step_size=self.config.prefill_chunk,
            kv_quantization=self.config.kv_quantization,
            cached_tokens=len(prefix.tokens) if prefix else 0,
            fed=fed,
            on_prompt=on_prompt,
            blocks=blocks,
            on_hidden=None if request.prompt_logprobs is None else lambda h, n: scorer.add(self.model.logits(h)[0]),
        )
        return cache, tokens
