"""Where does decode speed go behind the server? One process, one model, four ways to decode.

    python3 harness/gpu/diag_server_overhead.py --model qwen27b [--decode 64] [--samples 3]

  plain       engine generate, nothing else running
  +relay      the same, with an asyncio thread that receives every token through
              call_soon_threadsafe and JSON-encodes a chunk for it (the server's
              path minus the socket)
  +relay fast the same with sys.setswitchinterval(0.0005)
  continuous  a lone request through the ContinuousBatcher (the batched graph), no relay
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.engine import Engine
from engine.loading import vocab_size
from engine.types import CollectingSink, GenerationRequest, StopCriteria
from harness.prompts import frozen_prompt_ids


class Relay:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sent = 0

    def _handle(self, token_id: int) -> None:
        json.dumps({"choices": [{"index": 0, "text": "x", "token_ids": [token_id], "finish_reason": None}]})
        self.sent += 1

    def push(self, token_id: int) -> None:
        self.loop.call_soon_threadsafe(self._handle, token_id)


def rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen27b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--samples", type=int, default=3)
    args = ap.parse_args()
    eng = Engine.load(args.model, with_tokenizer=False)
    prompt = frozen_prompt_ids(args.prompt, vocab_size(eng.config))
    relay = Relay()

    def serial(push) -> float:
        stamps = []
        for t in eng.generate(prompt, max_tokens=args.decode, ignore_eos=True):
            stamps.append(time.perf_counter())
            if push:
                relay.push(t.token_id)
        return rate(stamps)

    def continuous() -> float:
        stamps = []

        class Clock(CollectingSink):
            def on_token(self, token):
                stamps.append(time.perf_counter())
                return True

        b = ContinuousBatcher(eng.model, SchedulerConfig(max_rows=8))
        b.submit(GenerationRequest("lone", tuple(prompt), stop=StopCriteria(max_tokens=args.decode, ignore_eos=True)),
                 Clock())  # fmt: skip
        b.run_until_idle()
        return rate(stamps)

    arms = {
        "plain": lambda: serial(False),
        "+relay": lambda: serial(True),
        "+relay fast": lambda: serial(True),
        "continuous": continuous,
    }
    results = {k: [] for k in arms}
    for k, fn in arms.items():  # one warmup each (kernels compile on first use)
        fn()
    for _ in range(args.samples):
        for k, fn in arms.items():
            sys.setswitchinterval(0.0005 if k == "+relay fast" else 0.005)
            results[k].append(fn())
    base = statistics.median(results["plain"])
    for k, v in results.items():
        m = statistics.median(v)
        print(f"{k:12s} decode {m:7.2f} tok/s  ratio {m / base:.3f}  samples {[round(x, 1) for x in v]}")
    print("relayed events:", relay.sent)


if __name__ == "__main__":
    main()
