"""`engine serve`: load the model, bind the socket, run the engine loop and uvicorn until a signal.

The engine loop owns the main thread; uvicorn serves HTTP from a second one.
The socket is bound first (a port in use is one line, before any loading),
and HTTP answers from then on: 503 "loading" until the model is loaded and
its warm-up requests went through, then the routes. The bound address is
printed when ready (`--port 0` picks a free port), so a launcher can read it
from the first line of stdout, or poll /health for a 200. SIGINT/SIGTERM stop
uvicorn gracefully (in-flight responses get a few seconds, then are
cancelled); then the engine loop ends.
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from engine.batch.runner import bucket, chunk_buckets, power_buckets, trace_forwards
from engine.batch.scheduler import SchedulerConfig
from engine.cache.prompt_disk import DiskTier, artifact_key
from engine.engine import Engine, kernels_notice
from engine.gateway import Gateway, GatewayConfig
from engine.generate import DEFAULT_PREFILL_STEP, KVQuantization
from engine.grammar import Grammars
from engine.kernels import FAST, KernelConfig, kernel_cache, on_cuda
from engine.kernels.cuda_source import builds as kernel_builds
from engine.kernels.indexing_warmup import compile_indexing
from engine.kernels.quantized_gemv import LAYER_MAX_ROWS
from engine.loading import text_config, vocab_size
from engine.request import GenerationRequest, StopCriteria
from engine.server.app import DEFAULT_MAX_BODY_BYTES, AppState, ServerContext, make_app
from engine.server.http_edges import DEFAULT_MAX_HEADER_BYTES, HeadLimit
from engine.server.reasoning import thinks
from engine.server.tool_calls import parser_for
from engine.server.worker import EngineWorker, QueueLimits
from engine.sinks import CollectingSink
from engine.speculative.config import SpecConfig, load_speculation

log = logging.getLogger("engine.server")

DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_MAX_TOKENS = 512  # when a request names none (mlx_lm.server's default too)
CUDA_BATCH, OTHER_BATCH = 64, 8  # the default --batch: on CUDA the fast tier's kernels take up to 64 rows
# the default --prefill-batch: on the fast tier a burst's prompts share fewer, larger prefill forwards (each reads
# the weights once); elsewhere mlx_lm.server's 8, which the same-B parity gates replay
FAST_PREFILL_BATCH = 32
# the default --mlx-cache on CUDA: device memory MLX keeps after it is freed, for reuse, at most half the device.
# MLX's own limit is 95% of the device, which lets one server's freed buffers starve any other process on the GPU
# (a second server fails to load). MLX caches a freed buffer only while its cache is under the limit and evicts
# only under memory pressure, so once the warm-up's shapes fill a small cache, a lone row's buffers go to
# cudaMallocAsync / cudaFreeAsync every step: on an H200 (qwen27b) a lone request after the full warm-up decoded
# at 0.755x the `--batch 1` server's rate with 16 GiB and 0.934x with 64 GiB (docs/serving.md).
CUDA_MLX_CACHE = 64 << 30


def cuda_cache_limit(device_info: Mapping) -> int:
    """The default --mlx-cache on CUDA: CUDA_MLX_CACHE, at most half of the device's memory where MLX reports it."""
    total = device_info.get("total_memory") or device_info.get("memory_size")
    return min(CUDA_MLX_CACHE, int(total) // 2) if isinstance(total, int) and total > 0 else CUDA_MLX_CACHE


def default_batch() -> int:
    return CUDA_BATCH if on_cuda() else OTHER_BATCH


def default_warmup() -> str:
    return "full" if on_cuda() else "quick"


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    model_path: Path | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    batch: int | None = None  # None: default_batch()
    prefill_chunk: int = DEFAULT_PREFILL_STEP
    kv_budget_bytes: int | None = None
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    prompt_cache_block: int = 256  # GatewayConfig.prompt_cache_block
    prompt_cache_dir: Path | None = None  # the prompt cache's disk tier (None: RAM only)
    prompt_cache_disk_bytes: int = 16 << 30
    max_context: int | None = None  # None: the model's max_position_embeddings
    kv_bits: int | None = None
    kv_group_size: int = 64
    api_key: str | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    kernels: KernelConfig | None = None  # None: KernelConfig() (tier auto)
    spec: SpecConfig | None = None  # speculative decoding; None: off
    draft_model: str | None = None  # registry name of the draft model (kind "draft")
    draft_model_path: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # a request head past this: 431 (`http_edges.HeadLimit`)
    allowed_hosts: frozenset[str] | None = None  # None: from the bound address (`allowed_hosts`)
    max_queued_requests: int | None = 256  # None: no limit
    max_queued_tokens: int | None = None
    decode_buckets: tuple[int, ...] | None = None  # None: auto (power_buckets on the fast tier); (): off
    chunk_buckets: tuple[int, ...] | None = None  # None: auto (runner.chunk_buckets on the fast tier); (): off
    group_buckets: tuple[int, ...] | None = None  # None: auto (power_buckets of the prefill group); (): off
    prefill_batch: int | None = None  # prompts prefilled together; None: auto (FAST_PREFILL_BATCH on the fast tier)
    prefill_budget: int | None = None  # None: auto (prefill_chunk on the fast tier); 0: off
    warmup: str | None = None  # full, quick or off; None: default_warmup()
    chat_template: str | None = None  # a Jinja chat template in place of the model's
    reasoning_parser: str = "auto"  # auto: a thinking template's <think> blocks go to reasoning_content; none: off
    kernel_cache_dir: Path | None = None  # MLX_PTX_CACHE_DIR (set by the caller): the engine's kernels go there too
    mlx_cache_bytes: int | None = None  # MLX's buffer cache limit; None: cuda_cache_limit on CUDA, MLX's elsewhere

    def gateway_config(self, tier: str | None = None) -> GatewayConfig:
        """The gateway's settings; `tier` (the kernel tier that loaded) resolves each auto: the fast tier pads
        decode rows and prefill groups to power_buckets and prefill chunks to chunk_buckets, and its joiners
        share one chunk's tokens an iteration; the exact tier does none of it (it stays bit-exact with mlx-lm's BatchGenerator,
        which pads neither and gives each joiner a whole chunk)."""
        kvq = None
        if self.kv_bits is not None:
            kvq = KVQuantization(bits=self.kv_bits, group_size=self.kv_group_size, start=0)
        batch = self.batch or default_batch()
        buckets = self.decode_buckets
        if buckets is None:
            buckets = power_buckets(batch) if tier == FAST and kvq is None and batch > 1 else ()
        prefill_batch = self.prefill_batch or (FAST_PREFILL_BATCH if tier == FAST else GatewayConfig.prefill_batch)
        groups = self.group_buckets
        if groups is None:
            groups = power_buckets(prefill_batch) if tier == FAST and kvq is None and batch > 1 else ()
        chunks = self.chunk_buckets
        if chunks is None:
            chunks = chunk_buckets(self.prefill_chunk) if tier == FAST else ()
        budget = self.prefill_budget
        if budget is None:
            budget = self.prefill_chunk if tier == FAST else 0
        return GatewayConfig(
            batch=batch,
            prefill_chunk=self.prefill_chunk,
            prefill_batch=prefill_batch,
            kv_budget_bytes=self.kv_budget_bytes,
            kv_quantization=kvq,
            prompt_cache_bytes=self.prompt_cache_bytes,
            prompt_cache_block=self.prompt_cache_block,
            decode_buckets=tuple(buckets),
            chunk_buckets=tuple(chunks),
            group_buckets=tuple(groups),
            prefill_budget=budget or None,
        )


def _context_of(config: dict) -> int:
    return int(text_config(config).get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
ANY_ADDRESS = ("0.0.0.0", "::", "")


def allowed_hosts(host: str, configured: frozenset[str] | None = None) -> frozenset[str] | None:
    """The Host header names the server accepts (None: any): `configured` ("*" in it: any), else those of the
    bound address: the loopback names for a loopback address, that address (and the loopback names) for
    another one, any for all interfaces (0.0.0.0, ::), whose names the server cannot know."""
    if configured is not None:
        return None if "*" in configured else frozenset(h.lower() for h in configured)
    if host in ANY_ADDRESS:
        return None
    return LOOPBACK | {host.lower().strip("[]")}


def longest_chunk(scheduler: SchedulerConfig, rows: int) -> int:
    """The longest chunk each of `rows` prefilling joiners takes in one forward: its share of the prefill budget,
    cut at the block snapshots' boundary where the batcher takes them (a hybrid model's prompt runs in
    `snapshot_block`-token chunks, so a longer prompt adds no forward shape)."""
    chunk = scheduler.chunk(rows)
    return min(chunk, scheduler.snapshot_block) if scheduler.snapshot_block else chunk


def _group_waves(
    config: GatewayConfig, scheduler: SchedulerConfig, context: int, fits
) -> list[list[GenerationRequest]]:
    """The full warm-up's prefill groups: for each group bucket past one, its fewest prompts (one more than the
    bucket below), each of a chunk bucket's length up to the bucket of the chunk such a group takes
    (`longest_chunk`), so that the group's prefill forwards (filled to the bucket) take every shape a burst can
    give them. `fits(rows, tokens)`: whether that many prompts of that length fit the KV budget. Every prompt
    opens with tokens of its own (its row, its wave), so that none starts from another's prefix in the prompt
    cache, which would run a shorter chunk than its wave is for."""
    waves, below = [], 1
    for group in config.group_buckets:
        if group > 1:
            rows = below + 1
            longest = bucket(longest_chunk(scheduler, rows), config.chunk_buckets)
            for n in config.chunk_buckets:
                if n <= longest and n + 3 <= context and fits(rows, n):
                    w = len(waves)
                    body = tuple(1 + i % 97 for i in range(n - 2))
                    waves.append(
                        [
                            GenerationRequest(
                                f"warmup-group-{group}-{n}-{j}",
                                (100 + j, 150 + w % 50, 200 + w // 50, *body),
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


def _prebuild_kernels(gateway: Gateway, cache: kernel_cache.KernelCache) -> WarmupStage:
    """Every decode bucket's and short prefill chunk's forward built but not run (`trace_forwards`), so that
    the engine's kernels they call compile at once (`cache`), before the requests that run them; MLX's
    indexing kernels compile meanwhile (`compile_indexing`)."""
    start, builds = time.perf_counter(), kernel_builds()
    trace_forwards(
        gateway.model,
        gateway.config.decode_buckets or (1,),
        [n for n in gateway.config.chunk_buckets if n <= LAYER_MAX_ROWS],
    )
    compile_indexing(gateway.model)  # MLX's own, while the engine's compile in other processes
    cache.settle()
    return WarmupStage("kernel builds", 0, 0, kernel_builds() - builds, round(time.perf_counter() - start, 3))


def _warm_up(
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
    each), and the prefill groups of each group bucket (`_group_waves`); with the kernel cache on, the
    kernels of all of them are built first (`_prebuild_kernels`; `prebuild` False leaves that stage out, for
    measuring what it changes). `off`: none. A warm-up request that fails stops the start (a setting the model cannot take would fail every
    request)."""
    if mode == "off":
        return []

    def request(name: str, prompt: tuple[int, ...], tokens: int = 2) -> GenerationRequest:
        return GenerationRequest(name, prompt, stop=StopCriteria(max_tokens=tokens, ignore_eos=True))

    report = []
    first = [request(f"warmup-{i}", (1, 2, 3)) for i in range(2 if gateway.batcher is not None else 1)]
    stages = [("first requests", [first])]
    if mode == "full" and gateway.batcher is not None:
        batch = gateway.config.batch
        first += [request(f"warmup-rows-{i}", (1, 2, 3 + i % 7), 2 + i) for i in range(batch)]
        stages = [(f"decode rows 1-{batch + 2}", [first])]
        # each opened by its own token, so that none reuses another's prefix from the prompt cache
        budget = gateway.config.kv_budget_bytes
        scheduler = gateway.batcher.scheduler.config
        buckets = gateway.config.chunk_buckets
        longest = bucket(longest_chunk(scheduler, 1), buckets)

        def fits(rows: int, n: int) -> bool:  # that many prompts of n tokens, each with 2 generated, in the KV budget
            return budget is None or rows * gateway.layout.row_bytes(n + 1, 2) <= budget

        # a prompt of each chunk bucket up to the longest chunk, and one of two longest chunks and a short one:
        # chunks after the first (a cache ahead of them, the caches growing) run kernels of their own, which a
        # long prompt would otherwise compile after ready
        lengths = [n for n in buckets if n <= longest] + ([2 * longest + buckets[0]] if buckets else [])
        chunks = [
            [request(f"warmup-chunk-{n}", (100 + k, *(1 + i % 97 for i in range(n))))]
            for k, n in enumerate(lengths)
            if n + 3 <= context and fits(1, n)
        ]
        groups = _group_waves(gateway.config, scheduler, context, fits)
        stages += [
            (f"prefill chunks ({len(chunks)} prompts)", chunks),
            (f"prefill groups ({len(groups)} shapes)", groups),
        ]
    if prebuild and mode == "full" and gateway.batcher is not None and kernel_cache.active() is not None:
        report.append(_prebuild_kernels(gateway, kernel_cache.active()))
        log(report[-1].line())
    sinks = []
    for name, waves in stages:
        if not waves:
            continue
        start, shapes, builds = time.perf_counter(), len(gateway.shapes), kernel_builds()
        for wave in waves:
            for r in wave:
                sinks.append(CollectingSink())
                gateway.submit(r, sinks[-1])
            gateway.run_until_idle()
        stage = WarmupStage(
            name,
            sum(len(w) for w in waves),
            len(gateway.shapes) - shapes,
            kernel_builds() - builds,
            round(time.perf_counter() - start, 3),
        )
        report.append(stage)
        log(stage.line())
    if gateway.prompt_cache is not None:
        gateway.prompt_cache.clear()  # a client's prompt must never reuse the warm-up's
    for sink in sinks:
        if sink.result is None or sink.result.error:
            setting = f" with --kv-bits {kv_bits}" if kv_bits else ""
            why = sink.result.error if sink.result else "it never ended"
            raise ValueError(f"this model cannot be served{setting}: a warm-up request failed ({why})")
    return report


def build(cfg: ServeConfig) -> tuple[EngineWorker, ServerContext]:
    """Load the model and the tokenizer; raises on a bad model or setting."""
    cfg.gateway_config()  # setting errors before any loading
    cache_limit = cfg.mlx_cache_bytes
    if cache_limit is None and on_cuda():
        cache_limit = cuda_cache_limit(mx.device_info())
    if cache_limit is not None:
        mx.set_cache_limit(cache_limit)
    if cfg.kernel_cache_dir is not None and on_cuda():
        kernel_cache.enable(cfg.kernel_cache_dir)
    engine = Engine.load(cfg.model, cfg.model_path, seed=cfg.seed, kernels=cfg.kernels)
    if cfg.chat_template is not None:
        engine.tokenizer.use_chat_template(cfg.chat_template)
    gateway_config = cfg.gateway_config(engine.kernels.tier)
    notice = kernels_notice(engine.kernels)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    speculation = None
    if cfg.spec is not None:
        speculation = load_speculation(
            cfg.spec, engine, cfg.draft_model, cfg.draft_model_path, seed=cfg.seed, prefill_step_size=cfg.prefill_chunk
        )
    gateway = Gateway(engine.model, gateway_config, speculation)
    start = time.perf_counter()
    warmup = cfg.warmup or default_warmup()
    context = cfg.max_context or _context_of(engine.config)
    stages = _warm_up(gateway, warmup, cfg.kv_bits, context, log=lambda line: print(line, file=sys.stderr, flush=True))
    # the warm-up's freed buffers (20 GB of qwen27b's, of shapes live traffic may never take) would stay in
    # MLX's cache, out of other processes' reach
    gc.collect()
    mx.clear_cache()
    if cfg.prompt_cache_dir is not None and gateway.prompt_cache is not None:  # after the warm-up: none of its entries
        full = gateway.prompt_cache.full_chunk  # quantized KV: entries are made and served past this first chunk
        kv = f"{cfg.kv_bits} bits, group {cfg.kv_group_size}, first chunk {full}" if cfg.kv_bits else "full"
        scheme = f"tier {engine.kernels.tier}, kv {kv}"
        disk = DiskTier(cfg.prompt_cache_dir, artifact_key(engine.path, scheme), cfg.prompt_cache_disk_bytes)
        gateway.prompt_cache.disk = disk
        print(
            f"engine serve: prompt cache disk tier {disk.dir}: {len(disk.entries)} entries, {disk.bytes:,} bytes"
            + (f" (off: {disk.error})" if disk.error else ""),
            file=sys.stderr,
            flush=True,
        )
    gateway.mark_ready()
    warmup_record = {
        "mode": warmup,
        "requests": sum(st.requests for st in stages),
        "seconds": round(time.perf_counter() - start, 3),
        "shapes": gateway.shapes_at_ready,
        "kernel_builds": gateway.kernel_builds_at_ready,
        "stages": [asdict(st) for st in stages],
        "kernel_cache": cache.stats() if (cache := kernel_cache.active()) else None,
    }
    model_id = cfg.model or engine.path.name
    try:
        from engine.server.metrics import Metrics

        metrics = Metrics(model_id)
    except ImportError:
        metrics = None  # /metrics answers 501
    worker = EngineWorker(gateway, QueueLimits(cfg.max_queued_requests, cfg.max_queued_tokens), metrics, warmup_record)
    ctx = ServerContext(
        worker=worker,
        tokenizer=engine.tokenizer,
        model_id=model_id,
        model_aliases=frozenset({str(engine.path), engine.path.name}),
        vocab_size=vocab_size(engine.config),
        max_context=context,
        default_max_tokens=cfg.default_max_tokens,
        api_key=cfg.api_key,
        created=int(time.time()),
        kernels=engine.kernels,
        metrics=metrics,
        tool_parser=parser_for(engine.tokenizer.chat_template),
        grammars=Grammars(engine.tokenizer.backend, sorted(engine.tokenizer.eos_ids), vocab_size(engine.config)),
        reasoning=cfg.reasoning_parser == "auto" and thinks(engine.tokenizer.chat_template),
        kernel_cache_dir=cfg.kernel_cache_dir,
        modules_at_ready=kernel_cache.module_files(cfg.kernel_cache_dir),
    )
    return worker, ctx


def listen(host: str, port: int) -> socket.socket:
    """The listening socket; ValueError (one line) where the address cannot be bound."""
    try:
        sock = socket.create_server((host, port), backlog=2048)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # Accepted connections inherit TCP_NODELAY. asyncio sets it only on sockets whose proto is
    # IPPROTO_TCP, which create_server's are not: without it, Nagle's algorithm meets the client's
    # delayed ACKs and a kept-alive connection gets its SSE tokens in ~40 ms bursts.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    start = time.perf_counter()
    cfg.gateway_config()  # setting errors before binding
    sock = listen(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    state = AppState(max_body_bytes=cfg.max_body_bytes, allowed_hosts=allowed_hosts(cfg.host, cfg.allowed_hosts))
    server = uvicorn.Server(
        uvicorn.Config(
            make_app(state),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            lifespan="off",
            http=HeadLimit,
            h11_max_incomplete_event_size=cfg.max_header_bytes,
        )
    )
    worker: EngineWorker | None = None
    stopped = threading.Event()

    def http() -> None:
        try:
            server.run(sockets=[sock])  # off the main thread, uvicorn leaves signals to us
        finally:
            stopped.set()
            if worker is not None:
                worker.stop()  # however HTTP ended, the engine loop follows

    thread = threading.Thread(target=http, name="http", daemon=True)
    thread.start()  # /health answers 503 "loading" meanwhile
    try:
        worker, ctx = build(cfg)
    except BaseException:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        raise
    state.ctx = ctx
    gw = worker.gateway.config
    spec = f", speculation {worker.gateway.speculation.describe()}" if worker.gateway.speculation else ""
    buckets = f", decode buckets {','.join(map(str, gw.decode_buckets))}" if gw.decode_buckets else ""
    warm = worker.warmup
    print(
        f"engine serve: ready on http://{host}:{port} (model {ctx.model_id}, batch {gw.batch}{buckets}, "
        f"kernels {ctx.kernels.tier} ({ctx.kernels.requested}), context {ctx.max_context}{spec}, loaded in "
        f"{time.perf_counter() - start:.1f} s, warm-up {warm['mode']} {warm['seconds']:.1f} s)",
        flush=True,
    )

    def on_signal(signum, frame) -> None:
        server.force_exit = server.should_exit  # a second signal: stop waiting for open responses
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if stopped.is_set():  # HTTP ended while the model loaded
        worker.stop()
    worker.run()
    written = worker.gateway.close()
    if written:
        print(f"engine serve: wrote {written} prompt cache entries to disk", flush=True)
    thread.join(timeout=10)
    sock.close()
    print("engine serve: stopped", flush=True)
    return 0
