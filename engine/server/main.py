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
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.allocator import loaded
from engine.cache.prompt_disk import DiskTier, artifact_key
from engine.device import limit_buffer_cache
from engine.engine import Engine, kernels_notice
from engine.gateway import Gateway, GatewayConfig
from engine.generate import DEFAULT_PREFILL_STEP, KVQuantization
from engine.grammar import Grammars
from engine.kernels import FAST, KernelConfig, on_cuda
from engine.kernels.kept import budget as dense_budget
from engine.kernels.kept import keep_within
from engine.kernels.kernel_cache import module_files
from engine.loading import context_of, vocab_size
from engine.server.app import DEFAULT_MAX_BODY_BYTES, AppState, make_app
from engine.server.context import ServerContext
from engine.server.http_edges import DEFAULT_MAX_HEADER_BYTES, HeadLimit, allowed_hosts, listen
from engine.server.reasoning import thinks
from engine.server.tool_calls import parser_for
from engine.server.worker import FAST_GATHER_MS, EngineWorker, QueueLimits
from engine.speculative.config import SpecConfig, load_speculation
from engine.speculative.rollback import Rollback
from engine.warmup import default_warmup, warm_dense_rows, warm_up, warmup_record

log = logging.getLogger("engine.server")

DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_MAX_TOKENS = 512  # when a request names none (mlx_lm.server's default too)


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    model_path: Path | None = None
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    batch: int | None = None  # None: gateway.default_batch()
    prefill_chunk: int = DEFAULT_PREFILL_STEP
    kv_budget: int | None = None  # bytes
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    prompt_cache_block: int = 256  # GatewayConfig.prompt_cache_block
    prompt_cache_dir: Path | None = None  # the prompt cache's disk tier (None: RAM only)
    prompt_cache_disk_bytes: int = 16 << 30
    max_context: int | None = None  # None: the model's max_position_embeddings
    kv_bits: int | None = None
    kv_group_size: int = 64
    api_key: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS  # a request's max_tokens where it names none
    kernels: KernelConfig | None = None  # None: KernelConfig() (tier auto)
    spec: SpecConfig | None = None  # speculative decoding; None: off
    spec_batch: bool = False  # speculation as spec rows in the continuous batch where it can (GatewayConfig)
    draft_model: str | None = None  # registry name of the draft model (kind "draft")
    draft_model_path: Path | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # a request head past this: 431 (`http_edges.HeadLimit`)
    allowed_hosts: frozenset[str] | None = None  # None: from the bound address (`allowed_hosts`)
    max_queued_requests: int | None = 256  # None: no limit
    max_queued_tokens: int | None = None
    decode_buckets: tuple[int, ...] | None = None  # None: auto (power_buckets on the fast tier); (): off
    prefill_buckets: tuple[int, ...] | None = None  # None: auto (runner.chunk_buckets on the fast tier); (): off
    prefill_groups: tuple[int, ...] | None = None  # None: auto (power_buckets of the prefill group); (): off
    prefill_batch: int | None = (
        None  # prompts prefilled together; None: auto (gateway.FAST_PREFILL_BATCH on the fast tier)
    )
    prefill_budget: int | None = None  # None: auto (prefill_chunk on the fast tier); 0: off
    idle_prefill_budget: int | None = None  # None: auto (gateway.IDLE_BUDGET_FACTOR x the budget, fast tier); 0: off
    prefill_itl: float | None = None  # None: auto (gateway.FAST_PREFILL_ITL on the fast tier); 0: off
    gather_ms: float | None = None  # EngineWorker.gather_s in ms; None: auto (FAST_GATHER_MS on the fast tier); 0: off
    warmup: str | None = None  # full, quick or off; None: warmup.default_warmup()
    chat_template: str | None = None  # a Jinja chat template in place of the model's
    reasoning_parser: str = "auto"  # auto: a thinking template's <think> blocks go to reasoning_content; none: off
    kernel_cache_dir: Path | None = None  # MLX_PTX_CACHE_DIR (set by the caller): the engine's kernels go there too
    mlx_cache: int | None = None  # bytes; MLX's buffer cache limit; None: cuda_cache_limit on CUDA, MLX's elsewhere

    def gather_seconds(self, tier: str | None) -> float:
        """`gather_ms` in seconds, auto resolved for the kernel tier that loaded: FAST_GATHER_MS on the fast tier,
        none on the exact tier (its groups form as mlx_lm.server's do, from what is queued at each step)."""
        if self.gather_ms is not None:
            return self.gather_ms / 1e3
        return FAST_GATHER_MS / 1e3 if tier == FAST else 0.0

    def gateway_config(self, tier: str | None = None) -> GatewayConfig:
        """The gateway's settings, each auto resolved for `tier`, the kernel tier that loaded
        (`GatewayConfig.for_tier`)."""
        kvq = None
        if self.kv_bits is not None:
            kvq = KVQuantization(bits=self.kv_bits, group_size=self.kv_group_size, start=0)
        return GatewayConfig.for_tier(
            tier,
            batch=self.batch,
            prefill_chunk=self.prefill_chunk,
            prefill_batch=self.prefill_batch,
            kv_budget=self.kv_budget,
            kv_quantization=kvq,
            prompt_cache_bytes=self.prompt_cache_bytes,
            prompt_cache_block=self.prompt_cache_block,
            decode_buckets=self.decode_buckets,
            prefill_buckets=self.prefill_buckets,
            prefill_groups=self.prefill_groups,
            prefill_budget=self.prefill_budget,
            idle_prefill_budget=self.idle_prefill_budget,
            prefill_itl=self.prefill_itl,
            spec_batch=self.spec_batch,
        )


def _say(line: str) -> None:
    """A start-up line to stderr, as the warm-up's stages print them."""
    print(line, file=sys.stderr, flush=True)


def build(cfg: ServeConfig) -> tuple[EngineWorker, ServerContext]:
    """Load the model and the tokenizer, warm the lanes up; raises on a bad model or setting (`serve` checks the
    settings before it binds)."""
    limit_buffer_cache(cfg.mlx_cache)
    engine = Engine.load(cfg.model, cfg.model_path, seed=cfg.seed, kernels=cfg.kernels)
    if cfg.kernel_cache_dir is not None and on_cuda():  # before any forward: the first builds the kernels
        engine.kernels.builds.enable_cache(cfg.kernel_cache_dir)
    if cfg.chat_template is not None:
        engine.tokenizer.use_chat_template(cfg.chat_template)
    notice = kernels_notice(engine.kernels)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    speculation = None
    if cfg.spec is not None:
        speculation = load_speculation(
            cfg.spec, engine, cfg.draft_model, cfg.draft_model_path, seed=cfg.seed, prefill_step_size=cfg.prefill_chunk
        )
    gateway = Gateway(engine.model, cfg.gateway_config(engine.kernels.tier), speculation, engine.kernels.builds)
    start = time.perf_counter()
    warmup = cfg.warmup or default_warmup()
    context = cfg.max_context or context_of(engine.config)
    stages = warm_up(gateway, warmup, cfg.kv_bits, context, log=_say)
    # the warm-up's freed buffers (20 GB of qwen27b's, of shapes live traffic may never take) would stay in
    # MLX's cache, out of other processes' reach
    gc.collect()
    mx.clear_cache()
    kept = None
    if engine.kernels.settings.get("keep_dense") == "auto":  # the copies take what the warm-up's peak leaves
        limit = dense_budget(mx.get_memory_limit(), mx.get_peak_memory(), cfg.kv_budget or 0)
        kept = keep_within(engine.model, limit)
        print(f"engine serve: {kept.line()}", file=sys.stderr, flush=True)
        if kept.matrices and engine.kernels.settings.get("dense_decode_rows"):  # launches on the copies: new forwards
            stages += warm_dense_rows(gateway, cfg.kv_bits, log=_say)
    if cfg.prompt_cache_dir is not None and gateway.prompt_cache is not None:  # after the warm-up: none of its entries
        full = gateway.prompt_cache.full_chunk  # quantized KV: entries are made and served past this first chunk
        kv = f"{cfg.kv_bits} bits, group {cfg.kv_group_size}, first chunk {full}" if cfg.kv_bits else "full"
        scheme = f"tier {engine.kernels.tier}, state {engine.kernels.settings.get('state_dtype', 'float32')}, kv {kv}"
        disk = DiskTier(cfg.prompt_cache_dir, artifact_key(engine.path, scheme), cfg.prompt_cache_disk_bytes)
        gateway.prompt_cache.disk = disk
        off = f" (off: {disk.error})" if disk.error else ""
        line = f"prompt cache disk tier {disk.dir}: {len(disk.entries)} entries, {disk.bytes:,} bytes{off}"
        print(f"engine serve: {line}", file=sys.stderr, flush=True)
    gateway.mark_ready()
    record = warmup_record(gateway, warmup, stages, time.perf_counter() - start)
    if kept is not None:
        record["kept_dense"] = kept.as_record()
    model_id = cfg.model or engine.path.name
    try:
        from engine.server.metrics import Metrics

        metrics = Metrics(model_id)
    except ImportError:
        metrics = None  # /metrics answers 501
    worker = EngineWorker(
        gateway,
        QueueLimits(cfg.max_queued_requests, cfg.max_queued_tokens),
        metrics,
        record,
        gather_s=cfg.gather_seconds(engine.kernels.tier),
    )
    ctx = ServerContext(
        worker=worker,
        tokenizer=engine.tokenizer,
        model_id=model_id,
        model_aliases=frozenset({str(engine.path), engine.path.name}),
        vocab_size=vocab_size(engine.config),
        max_context=context,
        default_max_tokens=cfg.max_tokens,
        api_key=cfg.api_key,
        created=int(time.time()),
        kernels=engine.kernels,
        metrics=metrics,
        tool_parser=parser_for(engine.tokenizer.chat_template),
        grammars=Grammars(engine.tokenizer.backend, sorted(engine.tokenizer.eos_ids), vocab_size(engine.config)),
        reasoning=cfg.reasoning_parser == "auto" and thinks(engine.tokenizer.chat_template),
        kernel_cache_dir=cfg.kernel_cache_dir,
        modules_at_ready=module_files(cfg.kernel_cache_dir),
    )
    return worker, ctx


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    start = time.perf_counter()
    cfg.gateway_config()  # setting errors before binding and loading
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
    if spec and gw.spec_batch and worker.gateway.speculation.config.rollback != Rollback.TRACE:
        spec += " (spec rows in the batch: trace rollback)"
    buckets = f", decode buckets {','.join(map(str, gw.decode_buckets))}" if gw.decode_buckets else ""
    warm = worker.warmup
    print(
        f"engine serve: ready on http://{host}:{port} (model {ctx.model_id}, batch {gw.batch}{buckets}, "
        f"kernels {ctx.kernels.tier} ({ctx.kernels.requested}), context {ctx.max_context}{spec}, loaded in "
        f"{time.perf_counter() - start:.1f} s, warm-up {warm['mode']} {warm['seconds']:.1f} s, allocator {loaded()})",
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
