"""What the HTTP server costs: the same greedy requests in-process and through `engine serve`.

Three arms on one artifact and the same prompt ids: `in-process` (engine
`generate`, no server), `serve --batch 1` (the serial lane behind HTTP) and
`serve` (the continuous lane, a lone request). Both servers run with their
prompt cache off, so every request is cold. Requests stream (SSE) with
`ignore_eos`; the client stamps the first and the last token event.

All three arms are loaded first; then each round runs one request per arm,
the order rotating from round to round, so a drift of the machine (large on
the lent GPU: one request decodes at 30 tok/s, the next at 50) hits every arm
alike. Per arm: median TTFT and decode rate ((tokens - 1) / (last - first))
after a warmup; per server arm also the geometric mean of its per-round
ratios to the in-process request of the same round.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from engine.engine import Engine
from harness.run.servers import engine_serve_command, free_port, start_server
from harness.run.stats import geomean
from oracles.cases import frozen_prompt_ids

IN_PROCESS, SERVE_SERIAL, SERVE = "in-process", "serve --batch 1", "serve"


@dataclass(frozen=True)
class OverheadConfig:
    prompt_tokens: int = 512
    decode_tokens: int = 128
    samples: int = 6
    warmup: int = 1


@dataclass
class ArmResult:
    arm: str
    ttft_ms: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the last sample's ids
    load_to_ready_s: float = 0.0

    @property
    def median_ttft_ms(self) -> float:
        return statistics.median(self.ttft_ms)

    @property
    def median_decode_tps(self) -> float:
        return statistics.median(self.decode_tps)


Run = Callable[[], tuple[float, float, float, list[int]]]


def _record(arm: ArmResult, sample: tuple[float, float, float, list[int]]) -> None:
    start, first, last, ids = sample
    arm.ttft_ms.append((first - start) * 1000)
    arm.decode_tps.append((len(ids) - 1) / (last - first))
    arm.tokens = ids


def _in_process(model_dir: Path, prompt: list[int], cfg: OverheadConfig) -> Run:
    eng = Engine.load(model_path=model_dir, with_tokenizer=False)

    def run():
        start, stamps, ids = time.perf_counter(), [], []
        for t in eng.generate(prompt, max_tokens=cfg.decode_tokens, ignore_eos=True):
            stamps.append(time.perf_counter())
            ids.append(t.token_id)
        return start, stamps[0], stamps[-1], ids

    return run


def _served(client, prompt: list[int], cfg: OverheadConfig) -> Run:
    body = {
        "prompt": prompt,
        "max_tokens": cfg.decode_tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }

    def run():
        start, stamps, ids = time.perf_counter(), [], []
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                got = event["choices"][0].get("token_ids", []) if event["choices"] else []
                if got:
                    stamps.append(time.perf_counter())
                    ids += got
        return start, stamps[0], stamps[-1], ids

    return run


def measure(model_dir: Path, vocab_size: int, cfg: OverheadConfig, log=lambda msg: None) -> list[ArmResult]:
    prompt = frozen_prompt_ids(cfg.prompt_tokens, vocab_size)
    model = ["--model-path", str(model_dir)]
    with ExitStack() as stack:
        runs, arms = [], []
        for label, flags in ((SERVE_SERIAL, ("--batch", "1")), (SERVE, ())):
            port = free_port()
            cmd = engine_serve_command(model, port, "--prompt-cache-bytes", "0", *flags)
            server = stack.enter_context(start_server(cmd, port))
            runs.append(_served(stack.enter_context(server.client()), prompt, cfg))
            arms.append(ArmResult(label, load_to_ready_s=server.load_to_ready_s))
        runs.insert(0, _in_process(model_dir, prompt, cfg))
        arms.insert(0, ArmResult(IN_PROCESS))
        for i in range(cfg.warmup + cfg.samples):
            log(f"round {i + 1}/{cfg.warmup + cfg.samples}" + (" (warmup)" if i < cfg.warmup else ""))
            order = [(i + k) % len(arms) for k in range(len(arms))]
            samples = {k: runs[k]() for k in order}
            if i >= cfg.warmup:
                for k, arm in enumerate(arms):
                    _record(arm, samples[k])
    return arms


def paired_decode_ratio(arm: ArmResult, base: ArmResult) -> float:
    """Geometric mean of per-round decode-rate ratios (arm / base)."""
    return geomean([a / b for a, b in zip(arm.decode_tps, base.decode_tps)])
