"""`harness startup`: what a user of `engine serve` waits for around a start.

One artifact, real server processes, frozen token-id prompts:

    start     `engine serve` with a kernel cache directory (a fresh one unless given): load to
              ready, the warm-up's stages and MLX's memory as the server reports them (/stats)
    first     one request right after ready: TTFT and decode rate
    burst-N   N requests at once, each its own prompt: TTFT quantiles, decode rate, and the
              forward shapes and kernel builds the server first ran during it (each a
              compilation on CUDA while requests waited)
    lone      rounds of one lone request to the default server and one to `--batch 1` (the
              serial lane, started first, on a kernel cache directory of its own unless
              `serial_kernel_cache` is "shared"), the order alternating, so a drift of the machine
              hits both alike: decode rates, the geometric mean of the per-round ratios, and the
              default server's MLX buffer cache after each round (a full cache sends a lone row's
              buffers to the device allocator at every step: docs/serving.md)
    restart   the default server again on the same kernel cache directory: load to ready

A request that fails is counted, never timed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from harness.run.client import RequestRecord, Timeouts, stream_completion
from harness.run.servers import (
    ServerProcess,
    ServerStartError,
    engine_serve_command,
    free_port,
    server_memory,
    server_stats,
    since_ready,
    start_server,
)
from harness.run.stats import geomean
from oracles.cases import frozen_prompt_ids

Log = Callable[[str], None]


@dataclass(frozen=True)
class StartupConfig:
    prompt_tokens: int = 128
    decode_tokens: int = 64  # a burst's and the first request's output
    bursts: tuple[int, ...] = (32,)
    lone_tokens: int = 128
    rounds: int = 3  # lone rounds against the serial lane; 0: no serial server
    restart: bool = True
    server_args: tuple[str, ...] = ()
    kernel_cache_dir: Path | None = None  # None: a fresh temporary directory
    # the serial server's kernel cache: "own" (a fresh directory: the default server's start is not helped by
    # what the serial one compiled) or "shared" (the default server's: no compilation where it is filled)
    serial_kernel_cache: str = "own"
    ttft_slo_ms: float = 2000.0
    ready_timeout_s: float = 1800.0
    seed: int = 0
    log_dir: Path | None = None  # each server's stdout and stderr under log_dir/<start label>/ (default: temporary)


@dataclass
class Start:
    label: str
    command: list[str]
    load_to_ready_s: float
    warmup: dict = field(default_factory=dict)  # the server's /stats "warmup"
    memory: dict = field(default_factory=dict)  # its /stats "memory" at ready: MLX's active, peak and cached bytes


@dataclass
class Requests:
    """Requests sent together (or one): what each measured, and what the server first ran meanwhile."""

    label: str
    size: int
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    new_shapes: int | None = None
    kernel_builds: int | None = None
    compiled_modules: int | None = None  # kernel modules compiled meanwhile (MLX's and the engine's)

    def quantile(self, q: float) -> float | None:
        return float(np.quantile(self.ttft_ms, q)) if self.ttft_ms else None

    @property
    def decode_tps(self) -> float | None:
        return 1000.0 / statistics.median(self.tpot_ms) if self.tpot_ms else None

    def meets(self, slo_ms: float) -> bool:
        """Every request answered, and the 99th percentile of TTFT within `slo_ms`."""
        return not self.errors and bool(self.ttft_ms) and self.quantile(0.99) <= slo_ms


@dataclass
class Lone:
    """Decode rates of lone requests, round by round, on the default server and the serial lane."""

    default_tps: list[float] = field(default_factory=list)
    serial_tps: list[float] = field(default_factory=list)
    # the default server's MLX buffer cache after each kept round: a full cache keeps a lone row's buffers out
    default_cache_bytes: list[int | None] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        pairs = list(zip(self.default_tps, self.serial_tps))
        return geomean([a / b for a, b in pairs]) if pairs else None


@dataclass
class StartupResult:
    model: str
    kernel_cache_dir: str
    starts: list[Start] = field(default_factory=list)
    requests: list[Requests] = field(default_factory=list)
    lone: Lone | None = None
    errors: list[str] = field(default_factory=list)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _send(client: httpx.Client, prompts: Sequence[list[int]], tokens: int, label: str, timeouts: Timeouts) -> Requests:
    """The prompts at once (one thread each); their records folded into a `Requests`."""
    before = since_ready(client)
    bodies = [{"prompt": p, "max_tokens": tokens, "ignore_eos": True, "temperature": 0} for p in prompts]
    records = [RequestRecord(label, 0, i, len(p)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        list(pool.map(lambda br: stream_completion(client, *br, timeouts), zip(bodies, records)))
    out = Requests(label, len(prompts), wall_s=time.perf_counter() - start)
    for r in records:
        if r.ok:
            out.ttft_ms.append(r.ttft_ms)
            if r.tpot_ms is not None:
                out.tpot_ms.append(r.tpot_ms)
        else:
            out.errors.append(r.error or "failed")
    after = since_ready(client)
    out.new_shapes, out.kernel_builds, out.compiled_modules = (
        None if None in (after[k], before[k]) else after[k] - before[k]
        for k in ("new_shapes", "kernel_builds", "compiled_modules")
    )
    return out


def measure(
    name: str, model_dir: Path, vocab_size: int, cfg: StartupConfig, log: Log = lambda m: None
) -> StartupResult:
    cache = cfg.kernel_cache_dir or Path(tempfile.mkdtemp(prefix="engine-kernel-cache-"))
    result = StartupResult(name, str(cache))
    timeouts = Timeouts(request_s=cfg.ready_timeout_s, stall_s=min(600.0, cfg.ready_timeout_s))
    serial_ids = iter(range(10**6))

    def prompt() -> list[int]:  # each request its own prompt: no prompt-cache hit between them
        return frozen_prompt_ids(cfg.prompt_tokens, vocab_size, seed=cfg.seed * 10**6 + next(serial_ids))

    def start(
        stack: ExitStack, label: str, *extra: str, kernels: Path | None = None
    ) -> tuple[ServerProcess, httpx.Client]:
        port = free_port()
        cmd = engine_serve_command(
            ["--model-path", str(model_dir)],
            port,
            "--kernel-cache-dir",
            str(kernels or cache),
            *cfg.server_args,
            *extra,
        )
        log(f"{label}: {' '.join(cmd[2:])}")
        logs = cfg.log_dir / label.split()[0] if cfg.log_dir else None
        server = stack.enter_context(start_server(cmd, port, timeout_s=cfg.ready_timeout_s, log_dir=logs))
        client = stack.enter_context(
            httpx.Client(
                base_url=server.url,
                timeout=timeouts.for_httpx(),
                limits=httpx.Limits(max_connections=max(cfg.bursts, default=1) + 8),
            )
        )
        started = Start(
            label,
            cmd,
            round(server.load_to_ready_s, 2),
            server_stats(client).get("warmup") or {},
            server_memory(client) or {},
        )
        result.starts.append(started)
        log(
            f"{label}: ready in {started.load_to_ready_s:.1f} s (warm-up {started.warmup.get('seconds', '-')} s, "
            f"MLX cache {_gib(started.memory.get('cache_bytes'))})"
        )
        return server, client

    def run(client: httpx.Client, label: str, n: int, tokens: int) -> Requests:
        got = _send(client, [prompt() for _ in range(n)], tokens, label, timeouts)
        result.requests.append(got)
        p99 = got.quantile(0.99)
        log(
            f"{label}: TTFT p99 {p99:.0f} ms, {len(got.errors)} failed, new shapes {got.new_shapes}, kernel builds "
            f"{got.kernel_builds}, modules compiled {got.compiled_modules}"
            if p99 is not None
            else f"{label}: every request failed ({got.errors[:1]})"
        )
        return got

    with ExitStack() as stack:
        serial, serial_stack = None, stack.enter_context(ExitStack())
        if cfg.rounds:  # first, so that the default server's memory (MLX keeps what it frees) cannot starve its load;
            # on a kernel cache of its own (unless shared), so that the default server's start is not helped by it
            serial_cache = cache
            if cfg.serial_kernel_cache == "own":
                serial_cache = Path(tempfile.mkdtemp(prefix="engine-kernel-cache-serial-"))
            try:
                _, serial = start(serial_stack, "serial (--batch 1)", "--batch", "1", kernels=serial_cache)
            except ServerStartError as e:  # the rest is measured without it
                result.errors.append(f"the serial server did not start: {e}")
                log(result.errors[-1][:2000])
        try:
            _, client = start(stack, "start")
        except ServerStartError as e:
            if serial is None:
                raise
            # one device may not hold both (qwen27b's warm-up beside a serial server on an 80 GB card ran out of
            # memory): the serial server stopped, the default one started alone (cold again), no lone rounds
            result.errors.append(f"the default server did not start beside the serial one; started alone: {e}")
            log(result.errors[-1][:2000])
            serial_stack.close()
            serial = None
            if cfg.kernel_cache_dir is None:
                cache = Path(tempfile.mkdtemp(prefix="engine-kernel-cache-"))
                result.kernel_cache_dir = str(cache)
            _, client = start(stack, "start")
        run(client, "first", 1, cfg.decode_tokens)
        for n in cfg.bursts:
            run(client, f"burst-{n}", n, cfg.decode_tokens)
        if serial is not None:
            result.lone = Lone()
            lanes = {"default": client, "serial": serial}
            for i in range(cfg.rounds + 1):  # the first round warms both up and is not kept
                order = list(lanes) if i % 2 == 0 else list(lanes)[::-1]
                tps = {
                    lane: _send(lanes[lane], [prompt()], cfg.lone_tokens, "lone", timeouts).decode_tps for lane in order
                }
                cached = (server_memory(client) or {}).get("cache_bytes")
                if i and None not in tps.values():
                    result.lone.default_tps.append(tps["default"])
                    result.lone.serial_tps.append(tps["serial"])
                    result.lone.default_cache_bytes.append(cached)
                log(
                    f"lone round {i + 1}/{cfg.rounds + 1}"
                    + (" (warm-up)" if i == 0 else "")
                    + ": "
                    + ", ".join(f"{lane} {v:.1f} tok/s" if v else f"{lane} failed" for lane, v in tps.items())
                    + f"; default server's MLX cache {_gib(cached)}"
                )
    if cfg.restart:
        with ExitStack() as stack:
            start(stack, "restart")
    return result
