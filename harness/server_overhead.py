"""What the HTTP server costs: the same greedy requests in-process and through `engine serve`.

Three arms on one artifact and the same prompt ids: `in-process` (engine
`generate`, no server), `serve --batch 1` (the serial lane behind HTTP) and
`serve` (the continuous lane, a lone request). Each server runs with its
prompt cache off so every request is cold. Requests stream (SSE) with
`ignore_eos`; the client stamps the first and the last token event. Per arm:
median TTFT and median decode rate ((tokens - 1) / (last - first)), over
`samples` requests after a warmup; ratios are arm / in-process. The arms run
one after another (each server is alone on the machine), in-process first.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine.engine import Engine
from harness.prompts import frozen_prompt_ids
from harness.servers import engine_serve_command, free_port, start_server

IN_PROCESS, SERVE_SERIAL, SERVE = "in-process", "serve --batch 1", "serve"


@dataclass(frozen=True)
class OverheadConfig:
    prompt_tokens: int = 512
    decode_tokens: int = 128
    samples: int = 5
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


def _sample(arm: ArmResult, run: Callable[[], tuple[float, float, float, list[int]]], cfg: OverheadConfig) -> None:
    for i in range(cfg.warmup + cfg.samples):
        start, first, last, ids = run()
        if i >= cfg.warmup:
            arm.ttft_ms.append((first - start) * 1000)
            arm.decode_tps.append((len(ids) - 1) / (last - first))
            arm.tokens = ids


def _in_process(model_dir: Path, prompt: list[int], cfg: OverheadConfig) -> ArmResult:
    eng = Engine.load(model_path=model_dir, with_tokenizer=False)

    def run():
        start, stamps, ids = time.perf_counter(), [], []
        for t in eng.generate(prompt, max_tokens=cfg.decode_tokens, ignore_eos=True):
            stamps.append(time.perf_counter())
            ids.append(t.token_id)
        return start, stamps[0], stamps[-1], ids

    arm = ArmResult(IN_PROCESS)
    _sample(arm, run, cfg)
    return arm


def _served(label: str, model_dir: Path, prompt: list[int], cfg: OverheadConfig, *flags: str) -> ArmResult:
    port = free_port()
    cmd = engine_serve_command(["--model-path", str(model_dir)], port, "--prompt-cache-bytes", "0", *flags)
    body = {"prompt": prompt, "max_tokens": cfg.decode_tokens, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # fmt: skip
    arm = ArmResult(label)
    with start_server(cmd, port) as server, server.client() as client:
        arm.load_to_ready_s = server.load_to_ready_s

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

        _sample(arm, run, cfg)
    return arm


def measure(model_dir: Path, vocab_size: int, cfg: OverheadConfig) -> list[ArmResult]:
    prompt = frozen_prompt_ids(cfg.prompt_tokens, vocab_size)
    return [
        _in_process(model_dir, prompt, cfg),
        _served(SERVE_SERIAL, model_dir, prompt, cfg, "--batch", "1"),
        _served(SERVE, model_dir, prompt, cfg),
    ]
