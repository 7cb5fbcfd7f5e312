"""A burst of prompts arriving together, served over HTTP against the same burst handed to the gateway in
process: whether the server's path (HTTP, threads, streaming) or the engine is what a served burst waits on.

    python3 -m tools.gpu.burst_paths --model qwen27b --burst 32 --prompt-tokens 128 --rounds 3 --warmup full

Two arms, one after the other (never both on the device at once), each over `--rounds` measured rounds after
one unmeasured round, every prompt its own tokens (none starts from another's cached prefix), max_tokens 2:

    served    `engine serve` at its defaults with `--warmup`; the burst's requests sent at once over HTTP
              (streamed completions with token-ID prompts); TTFT from the first request's send to each one's
              first streamed token
    gateway   a Gateway as `engine serve` sets it up, warmed the same way; every request submitted at once,
              then run until idle; TTFT from the first submit to each one's first token

Each round prints its TTFT p50, p90 and last; the end, each arm's medians over the rounds and the served arm's
ratio to the gateway's. Where the ratio is near 1 the engine's own work is the burst's time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Burst:
    """The burst's shape and how many rounds each arm runs."""

    size: int = 32
    prompt_tokens: int = 128
    rounds: int = 3

    def prompts(self, salt: int) -> list[list[int]]:
        """`size` prompts of `prompt_tokens` ids under 1,000, their second id the round's (`salt`, under 900 apart
        from other rounds'), the rest each prompt's own: no two share more than 2 ids, so none starts from another's
        cached prefix."""
        n = self.prompt_tokens
        return [
            [5 + i % 50, 10 + salt % 900, *((7 * j + 11 * i + 13 * salt) % 900 + 10 for j in range(n - 2))]
            for i in range(self.size)
        ]


def summary(ttfts_ms: list[float]) -> tuple[float, float, float]:
    """p50, p90 and the last of one round's TTFTs (ms)."""
    ordered = sorted(ttfts_ms)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))], ordered[-1]


def report(arm: str, rounds: list[list[float]]) -> tuple[float, float, float]:
    """Each measured round's line, then the arm's medians over the rounds."""
    rows = [summary(r) for r in rounds]
    for i, (p50, p90, last) in enumerate(rows, 1):
        print(f"{arm} round {i}: TTFT p50 {p50:.0f} ms, p90 {p90:.0f}, last {last:.0f}", flush=True)
    return tuple(statistics.median(column) for column in zip(*rows))


def served_rounds(model_args: list[str], warmup: str, burst: Burst) -> list[list[float]]:
    from harness.run.servers import engine_serve_command, free_port, start_server

    port = free_port()
    server = start_server(engine_serve_command(model_args, port, "--warmup", warmup), port, timeout_s=1800)
    try:
        with server.client() as c:
            model_id = c.get("/v1/models").json()["data"][0]["id"]
        print(f"served: ready in {server.load_to_ready_s:.1f} s", flush=True)

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> float:
            body = {"model": model_id, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"choices"' in line:
                        return time.perf_counter()
            raise RuntimeError("a streamed completion ended before its first token")

        async def run() -> list[list[float]]:
            rounds = []
            limits = httpx.Limits(max_connections=burst.size + 8)
            async with httpx.AsyncClient(base_url=server.url, timeout=1800, limits=limits) as client:
                for r in range(burst.rounds + 1):
                    start = time.perf_counter()
                    firsts = await asyncio.gather(*(one(client, p) for p in burst.prompts(100 + r)))
                    if r:
                        rounds.append([(t - start) * 1e3 for t in firsts])
            return rounds

        return asyncio.run(run())
    finally:
        server.stop()


def gateway_rounds(model: str | None, model_path: str | None, warmup: str, burst: Burst) -> list[list[float]]:
    from tools.gpu.as_served import prepare_device

    prepare_device()  # before MLX compiles anything

    from engine.request import GenerationRequest, StopCriteria
    from tools.gpu.as_served import warmed_gateway
    from tools.gpu.lone_lanes import Stamps

    _, gateway, _ = warmed_gateway(model, model_path, warmup)
    rounds = []
    for r in range(burst.rounds + 1):
        sinks = [Stamps() for _ in range(burst.size)]
        start = time.perf_counter()
        for i, (prompt, sink) in enumerate(zip(burst.prompts(500 + r), sinks)):
            stop = StopCriteria(max_tokens=2, ignore_eos=True)
            gateway.submit(GenerationRequest(f"burst{r}-{i}", tuple(prompt), stop=stop), sink)
        gateway.run_until_idle()
        for sink in sinks:
            if sink.result is None or sink.result.error or not sink.stamps:
                why = sink.result.error if sink.result is not None and sink.result.error else "no first token"
                raise SystemExit(f"a burst's request failed: {why}")
        if r:
            rounds.append([(s.stamps[0] - start) * 1e3 for s in sinks])
    return rounds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b", help="registry name (synthesized on first use)")
    p.add_argument("--model-path", help="an mlx-lm model directory instead")
    p.add_argument("--burst", type=int, default=32, help="requests sent at once")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds an arm, after one unmeasured round")
    p.add_argument("--warmup", choices=("off", "quick", "full"), default="full", help="engine serve's warm-up")
    p.add_argument("--arms", default="served,gateway", help="comma-separated: served, gateway")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or set(arms) - {"served", "gateway"}:
        p.error(f"--arms takes served and gateway (got {args.arms!r})")
    if min(args.burst, args.rounds) < 1 or args.prompt_tokens < 3:
        p.error("--burst and --rounds must be at least 1, --prompt-tokens at least 3")
    burst = Burst(args.burst, args.prompt_tokens, args.rounds)
    model_args = ["--model-path", args.model_path] if args.model_path else ["--model", args.model]
    medians = {}
    for arm in arms:
        if arm == "served":
            rounds = served_rounds(model_args, args.warmup, burst)
        else:
            rounds = gateway_rounds(None if args.model_path else args.model, args.model_path, args.warmup, burst)
        medians[arm] = report(arm, rounds)
    for arm, (p50, p90, last) in medians.items():
        print(f"{arm}: median over {burst.rounds} rounds: TTFT p50 {p50:.0f} ms, p90 {p90:.0f}, last {last:.0f}")
    if len(medians) == 2:
        ratios = [s / g for s, g in zip(medians["served"], medians["gateway"])]
        print("served / gateway: p50 {:.2f}x, p90 {:.2f}x, last {:.2f}x".format(*ratios))


if __name__ == "__main__":
    main()
