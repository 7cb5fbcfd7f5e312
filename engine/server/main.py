"""`engine serve`: load the model, bind the socket, run the engine loop and uvicorn until a signal.

The engine loop owns the main thread; uvicorn serves HTTP from a second one.
The bound address is printed once the model is loaded and the socket
listens (`--port 0` picks a free port), so a launcher can read it from the
first line of stdout. SIGINT/SIGTERM stop uvicorn gracefully (in-flight
responses get a few seconds, then are cancelled); then the engine loop ends.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.engine import Engine, kernels_notice
from engine.kernels import KernelConfig
from engine.gateway import Gateway, GatewayConfig
from engine.generate import DEFAULT_PREFILL_STEP, KVQuantization
from engine.loading import text_config, vocab_size
from engine.server.app import ServerContext, make_app
from engine.server.worker import EngineWorker
from engine.spec.config import SpecConfig, load_speculation
from engine.types import CollectingSink, GenerationRequest, StopCriteria

log = logging.getLogger("engine.server")

DEFAULT_PROMPT_CACHE_BYTES = 2 << 30
DEFAULT_MAX_TOKENS = 512  # when a request names none (mlx_lm.server's default too)


@dataclass(frozen=True)
class ServeConfig:
    model: Optional[str] = None
    model_path: Optional[Path] = None
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    batch: int = 8
    prefill_chunk: int = DEFAULT_PREFILL_STEP
    kv_budget_bytes: Optional[int] = None
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES
    max_context: Optional[int] = None  # None: the model's max_position_embeddings
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    api_key: Optional[str] = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    kernels: Optional[KernelConfig] = None  # None: KernelConfig() (tier auto)
    spec: Optional[SpecConfig] = None  # speculative decoding; None: off
    draft_model: Optional[str] = None  # registry name of the draft model (kind "draft")
    draft_model_path: Optional[Path] = None

    def gateway_config(self) -> GatewayConfig:
        kvq = None
        if self.kv_bits is not None:
            kvq = KVQuantization(bits=self.kv_bits, group_size=self.kv_group_size, start=0)
        return GatewayConfig(
            batch=self.batch,
            prefill_chunk=self.prefill_chunk,
            kv_budget_bytes=self.kv_budget_bytes,
            kv_quantization=kvq,
            prompt_cache_bytes=self.prompt_cache_bytes,
        )


def _context_of(config: dict) -> int:
    return int(text_config(config).get("max_position_embeddings") or config.get("max_position_embeddings") or 4096)


def _warm_up(gateway: Gateway) -> None:
    """One short request through each lane, so the first client does not pay for kernel compilation."""
    for i in range(2 if gateway.batcher is not None else 1):
        gateway.submit(GenerationRequest(f"warmup-{i}", (1, 2, 3), stop=StopCriteria(max_tokens=2, ignore_eos=True)),
                       CollectingSink())  # fmt: skip
    gateway.run_until_idle()
    if gateway.prompt_cache is not None:
        gateway.prompt_cache.clear()  # a client's prompt must never reuse the warm-up's


def build(cfg: ServeConfig) -> tuple[EngineWorker, ServerContext]:
    """Load the model and the tokenizer; raises on a bad model or setting."""
    gateway_config = cfg.gateway_config()  # setting errors before any loading
    engine = Engine.load(cfg.model, cfg.model_path, seed=cfg.seed, kernels=cfg.kernels)
    notice = kernels_notice(engine.kernels)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    speculation = None
    if cfg.spec is not None:
        speculation = load_speculation(
            cfg.spec, engine, cfg.draft_model, cfg.draft_model_path, seed=cfg.seed, prefill_step_size=cfg.prefill_chunk
        )
    gateway = Gateway(engine.model, gateway_config, speculation)
    _warm_up(gateway)
    worker = EngineWorker(gateway)
    model_id = cfg.model or engine.path.name
    context = cfg.max_context or _context_of(engine.config)
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
    )
    return worker, ctx


def listen(host: str, port: int) -> socket.socket:
    sock = socket.create_server((host, port), backlog=2048)
    # Accepted connections inherit TCP_NODELAY. asyncio sets it only on sockets whose proto is
    # IPPROTO_TCP, which create_server's are not: without it, Nagle's algorithm meets the client's
    # delayed ACKs and a kept-alive connection gets its SSE tokens in ~40 ms bursts.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    start = time.perf_counter()
    worker, ctx = build(cfg)
    sock = listen(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    gw = cfg.gateway_config()
    spec = f", speculation {worker.gateway.speculation.describe()}" if worker.gateway.speculation else ""
    print(
        f"engine serve: ready on http://{host}:{port} (model {ctx.model_id}, batch {gw.batch}, "
        f"kernels {ctx.kernels.tier} ({ctx.kernels.requested}), context {ctx.max_context}{spec}, loaded in {time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(make_app(ctx), log_level="warning", access_log=False, timeout_graceful_shutdown=5, lifespan="off")
    )

    def http() -> None:
        try:
            server.run(sockets=[sock])  # off the main thread, uvicorn leaves signals to us
        finally:
            worker.stop()  # however HTTP ended, the engine loop follows

    def on_signal(signum, frame) -> None:
        server.force_exit = server.should_exit  # a second signal: stop waiting for open responses
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=http, name="http", daemon=True)
    thread.start()
    worker.run()
    thread.join(timeout=10)
    sock.close()
    print("engine serve: stopped", flush=True)
    return 0
