"""The warm-up: requests through the lanes before the server says ready, so that clients do not wait while
kernels compile, and the record of it that /stats reports."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from engine.batch.runner import bucket, trace_forwards
from engine.batch.scheduler import SchedulerConfig
from engine.gateway import Gateway, GatewayConfig
from engine.kernels import on_cuda
from engine.kernels.indexing_warmup import compile_indexing
from engine.kernels.kernel_cache import KernelCache
from engine.kernels.quantized_gemv import LAYER_MAX_ROWS
from engine.request import GenerationRequest, StopCriteria
from engine.sinks import CollectingSink


def default_warmup() -> str:
    """The default --warmup: `full` on CUDA, where every new forward shape compiles kernels; `quick` elsewhere."""
    return "full" if on_cuda() else "quick"


def longest_chunk(scheduler: SchedulerConfig, rows: int) -> int:
    """The longest chunk each of `rows` prefilling joiners takes in one forward: its share of the idle prefill
    budget, where a burst reaching an idle server starts (block snapshots cut no chunk: they are kept from inside
    the forwards; a share of the budget beside decoding rows is one of the chunk buckets up to it)."""
    return scheduler.chunk(rows, idle=True)


def group_waves(config: GatewayConfig, scheduler: SchedulerConfig, context: int, fits) -> list[list[GenerationRequest]]:
    """The full warm-up's prefill groups: for each group bucket past one, its fewest prompts (one more than the
    bucket below), of a chunk bucket's length up to the bucket of the chunk such a group takes (`longest_chunk`),
    every other one a token shorter, so that the group's prefill forwards (filled and right-padded to the bucket)
    take every shape a burst can give them. `fits(rows, tokens)`: whether that many prompts of that length fit the
    KV budget. Every prompt opens with tokens of its own (its row, its wave), so that none starts from another's
    prefix in the prompt cache, which would run a shorter chunk than its wave is for."""
    waves, below = [], 1
    for group in config.prefill_groups:
        if group > 1:
            rows = below + 1
            longest = bucket(longest_chunk(scheduler, rows), config.prefill_buckets)
            for n in config.prefill_buckets:
                if n <= longest and n + 3 <= context and fits(rows, n):
                    w = len(waves)
                    body = tuple(1 + i % 97 for i in range(n - 2))
                    waves.append(
                        [
                            GenerationRequest(
                                f"warmup-group-{group}-{n}-{j}",
                                (100 + j, 150 + w % 50, 200 + w // 50, *body[: len(body) - j % 2]),
                                stop=StopCriteria(max_tokens=2, ignore_eos=True),
                            )
                            for j in range(rows)
                        ]
                    )
        below = group
    return waves


@dataclass(frozen=True)
class WarmupStage:
    """One stage of the warm-up: its requests, the forward shapes and custom-kernel builds (each a compilation
    on CUDA) that were new in it, and its wall time."""

    name: str
    requests: int
    shapes: int
    kernel_builds: int
    seconds: float

    def line(self) -> str:
        return (
            f"engine serve: warm-up {self.name}: {self.requests} requests, {self.shapes} new shapes, "
            f"{self.kernel_builds} kernel builds, {self.seconds:.1f} s"
        )


def prebuild_kernels(gateway: Gateway, cache: KernelCache) -> WarmupStage:
    """Every decode bucket's and short prefill chunk's forward built but not run (`trace_forwards`), so that
    the engine's kernels they call compile at once (`cache`), before the requests that run them; MLX's
    indexing kernels compile meanwhile (`compile_indexing`)."""
    start, builds = time.perf_counter(), gateway.builds.count()
    trace_forwards(
        gateway.model,
        gateway.config.decode_buckets or (1,),
        [n for n in gateway.config.prefill_buckets if n <= LAYER_MAX_ROWS],
    )
    compile_indexing(gateway.model)  # MLX's own, while the engine's compile in other processes
    cache.settle()
    return WarmupStage("kernel builds", 0, 0, gateway.builds.count() - builds, round(time.perf_counter() - start, 3))


def warm_up(
    gateway: Gateway,
    mode: str,
    kv_bits: int | None = None,
    context: int = 4096,
    log: Callable[[str], None] = lambda line: None,
    prebuild: bool = True,
) -> list[WarmupStage]:
    """Requests through the lanes before the server says ready, so that clients do not wait while kernels
    compile; returns its stages, each passed to `log` as it ends. `quick`: one short request (two on the
    continuous lane, decoding together). `full`: also `batch` requests at once on the continuous lane, each
    a token longer than the one before, so the decode batch takes every row count (every decode bucket) on
    its way up and down; then, one at a time, a prompt a prefill chunk bucket long (up to the longest chunk
    one takes, `longest_chunk`), one of two such chunks and a short one (within `context` and the KV budget
    each), and the prefill groups of each group bucket (`group_waves`); with the kernel cache on, the
    kernels of all of them are built first (`prebuild_kernels`; `prebuild` False leaves that stage out, for
    measuring what it changes). `off`: none. A warm-up request that fails stops the start (a setting the
    model cannot take would fail every request)."""
    if mode == "off":
        return []

    report = []
    first = [_request(f"warmup-{i}", (1, 2, 3)) for i in range(2 if gateway.batcher is not None else 1)]
    stages = [("first requests", [first])]
    if mode == "full" and gateway.batcher is not None:
        batch = gateway.config.batch
        first += _decode_rows("warmup-rows", batch)
        stages = [(f"decode rows 1-{batch + 2}", [first])]
        # each opened by its own token, so that none reuses another's prefix from the prompt cache
        budget = gateway.config.kv_budget
        scheduler = gateway.batcher.scheduler.config
        buckets = gateway.config.prefill_buckets
        longest = bucket(longest_chunk(scheduler, 1), buckets)

        def fits(rows: int, n: int) -> bool:  # that many prompts of n tokens, each with 2 generated, in the KV budget
            probe = _request("fits", (0,) * (n + 1))  # (a spec row's: with its verify window and draft caches)
            return budget is None or rows * sum(gateway.kv_need(probe, gateway.place(probe))) <= budget

        # a prompt of each chunk bucket up to the longest chunk, once filling it and once a token short of it
        # (right-padded to it: masked and rolled after, the path of nearly every client's prompt), and one of two
        # longest chunks and a short right-padded one: chunks after the first (a cache ahead of them, the caches
        # growing) run kernels of their own, which a long prompt would otherwise compile after ready
        full = [n for n in buckets if n <= longest]
        short = [n - 1 for n in full if n > 1 and bucket(n - 1, buckets) == n]
        lengths = full + short + ([2 * longest + buckets[0] - 1] if buckets else [])
        chunks = [
            [_request(f"warmup-chunk-{k}-{n}", (100 + k, *(1 + i % 97 for i in range(n))))]
            for k, n in enumerate(lengths)
            if n + 3 <= context and fits(1, n)
        ]
        groups = group_waves(gateway.config, scheduler, context, fits)
        stages += [
            (f"prefill chunks ({len(chunks)} prompts)", chunks),
            (f"prefill groups ({len(groups)} shapes)", groups),
        ]
    if prebuild and mode == "full" and gateway.batcher is not None and gateway.builds.cache is not None:
        report.append(prebuild_kernels(gateway, gateway.builds.cache))
        log(report[-1].line())
    return report + run_stages(gateway, stages, kv_bits, log)


def warm_dense_rows(
    gateway: Gateway, kv_bits: int | None = None, log: Callable[[str], None] = lambda line: None
) -> list[WarmupStage]:
    """After dense copies are kept (`kept.keep_within`), launches of `dense_decode_rows` rows and more run on them
    (`quantized_gemv.dense`), forwards the warm-up did not run: requests decoding together, the batch taking every
    row count again (the continuous lane only; none without it)."""
    if gateway.batcher is None:
        return []
    batch = gateway.config.batch
    wave = _decode_rows("warmup-dense", batch)
    return run_stages(gateway, [(f"decode rows on dense copies 1-{batch}", [wave])], kv_bits, log)


def _request(name: str, prompt: tuple[int, ...], tokens: int = 2) -> GenerationRequest:
    return GenerationRequest(name, prompt, stop=StopCriteria(max_tokens=tokens, ignore_eos=True))


def _decode_rows(prefix: str, batch: int) -> list[GenerationRequest]:
    """`batch` requests sent at once, each a token longer than the one before: the decode batch takes every row
    count (every decode bucket) on its way up and down."""
    return [_request(f"{prefix}-{i}", (1, 2, 3 + i % 7), 2 + i) for i in range(batch)]


def run_stages(gateway: Gateway, stages: list, kv_bits: int | None, log: Callable[[str], None]) -> list[WarmupStage]:
    """Each stage's waves of requests, a wave at a time until idle; then the prompt cache emptied and the pacer's
    gaps forgotten; ValueError where a request failed."""
    report, sinks = [], []
    for name, waves in stages:
        if not waves:
            continue
        start, shapes, builds = time.perf_counter(), len(gateway.shapes), gateway.builds.count()
        for wave in waves:
            for r in wave:
                sinks.append(CollectingSink())
                gateway.submit(r, sinks[-1])
            gateway.run_until_idle()
        stage = WarmupStage(
            name,
            sum(len(w) for w in waves),
            len(gateway.shapes) - shapes,
            gateway.builds.count() - builds,
            round(time.perf_counter() - start, 3),
        )
        report.append(stage)
        log(stage.line())
    if gateway.prompt_cache is not None:
        gateway.prompt_cache.clear()  # a client's prompt must never reuse the warm-up's
    if gateway.batcher is not None and gateway.batcher.pacer is not None:
        gateway.batcher.pacer.forget()  # its gaps timed compilations
    for sink in sinks:
        if sink.result is None or sink.result.error:
            setting = f" with --kv-bits {kv_bits}" if kv_bits else ""
            why = sink.result.error if sink.result else "it never ended"
            raise ValueError(f"this model cannot be served{setting}: a warm-up request failed ({why})")
    return report


def warmup_record(gateway: Gateway, mode: str, stages: list[WarmupStage], seconds: float) -> dict:
    """What /stats reports of the warm-up, once the gateway is marked ready."""
    return {
        "mode": mode,
        "requests": sum(st.requests for st in stages),
        "seconds": round(seconds, 3),
        "shapes": gateway.shapes_at_ready,
        "kernel_builds": gateway.kernel_builds_at_ready,
        "stages": [asdict(st) for st in stages],
        "kernel_cache": cache.stats() if (cache := gateway.builds.cache) else None,
    }
