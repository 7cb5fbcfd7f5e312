"""A burst of prompts arriving together, served over HTTP against the same burst handed to the gateway in
process: whether the server's path (HTTP, threads, streaming) or the engine is what a served burst waits on.

    python3 -m tools.gpu.burst_paths --model qwen27b --burst 32 --prompt-tokens 128 --rounds 3 --warmup full

Two arms, one after the other (never both on the device at once), each over `--rounds` measured rounds after
one unmeasured round, every prompt its own tokens (none starts from another's cached prefix), max_tokens
`--tokens` (2):

    served    `engine serve` at its defaults with `--warmup`; the burst's requests sent at once over HTTP
              (streamed completions with token-ID prompts); TTFT from the first request's send to each one's
              first streamed token
    gateway   a Gateway as `engine serve` sets it up, warmed the same way; every request submitted at once,
              then run until idle; TTFT from the first submit to each one's first token

Each round prints its TTFT p50, p90 and last; the end, each arm's medians over the rounds and the served arm's
ratio to the gateway's. Where the ratio is near 1 the engine's own work is the burst's time.

With `--tokens` above 2 each round also prints the decode of the whole batch: the gaps between a request's
tokens once every request has its first (all rows decoding, no prefill beside them), p50 and p90, and the
round's tokens a second from the first send to the last token. A served step longer than the gateway's is
the server's own cost a step (HTTP, streaming, threads):

    python3 -m tools.gpu.burst_paths --model qwen27b --burst 64 --tokens 256 --rounds 2
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
    tokens: int = 2  # max_tokens a request

    def prompts(self, salt: int) -> list[list[int]]:
        """`size` prompts of `prompt_tokens` ids under 1,000, their second id the round's (`salt`, under 900 apart
        from other rounds'), the rest each prompt's own: no two share more than 2 ids, so none starts from another's
        cached prefix."""
        n = self.prompt_tokens
        return [
            [5 + i % 50, 10 + salt % 900, *((7 * j + 11 * i + 13 * salt) % 900 + 10 for j in range(n - 2))]
            for i in range(self.size)
        ]


def _p50_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


def summary(start: float, stamps: list[list[float]]) -> tuple[float, ...]:
    """One round's TTFT p50, p90 and last (ms, from `start`, the first send); from 3 tokens a request also the gaps
    between tokens once every request had its first, p50 and p90 (ms), and the round's tokens a second."""
    firsts = [s[0] for s in stamps]
    p50, p90 = _p50_p90([(t - start) * 1e3 for t in firsts])
    out = (p50, p90, (max(firsts) - start) * 1e3)
    if min(len(s) for s in stamps) < 3:
        return out
    decoding = max(firsts)
    gaps = [(b - a) * 1e3 for s in stamps for a, b in zip(s, s[1:]) if a >= decoding]
    rate = sum(len(s) for s in stamps) / (max(s[-1] for s in stamps) - start)
    return out + (*_p50_p90(gaps or [float("nan")]), rate)


def report(arm: str, rounds: list[tuple[float, ...]]) -> tuple[float, ...]:
    """Each measured round's line, then the arm's medians over the rounds."""
    for i, row in enumerate(rounds, 1):
        line = f"{arm} round {i}: TTFT p50 {row[0]:.0f} ms, p90 {row[1]:.0f}, last {row[2]:.0f}"
        if len(row) > 3:
            line += f"; decode gap p50 {row[3]:.1f} ms, p90 {row[4]:.1f}, {row[5]:.0f} tok/s"
        print(line, flush=True)
    return tuple(statistics.median(column) for column in zip(*rounds))


def served_rounds(model_args: list[str], warmup: str, burst: Burst) -> list[tuple[float, ...]]:
    from harness.run.servers import engine_serve_command, free_port, start_server

    port = free_port()
    server = start_server(engine_serve_command(model_args, port, "--warmup", warmup), port, timeout_s=1800)
    try:
        with server.client() as c:
            model_id = c.get("/v1/models").json()["data"][0]["id"]
        print(f"served: ready in {server.load_to_ready_s:.1f} s", flush=True)

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[float]:
            """When each streamed chunk with a choice came (a token's text each)."""
            body = {"model": model_id, "prompt": prompt, "max_tokens": burst.tokens, "stream": True, "ignore_eos": True}
            stamps = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"choices"' in line:
                        stamps.append(time.perf_counter())
            if not stamps:
                raise RuntimeError("a streamed completion ended before its first token")
            return stamps

        async def run() -> list[tuple[float, ...]]:
            rounds = []
            limits = httpx.Limits(max_connections=burst.size + 8)
            async with httpx.AsyncClient(base_url=server.url, timeout=1800, limits=limits) as client:
                for r in range(burst.rounds + 1):
                    start = time.perf_counter()
                    stamps = await asyncio.gather(*(one(client, p) for p in burst.prompts(100 + r)))
                    if r:
                        rounds.append(summary(start, stamps))
            return rounds

        return asyncio.run(run())
    finally:
        server.stop()


def gateway_rounds(model: str | None, model_path: str | None, warmup: str, burst: Burst) -> list[tuple[float, ...]]:
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
            stop = StopCriteria(max_tokens=burst.tokens, ignore_eos=True)
            gateway.submit(GenerationRequest(f"burst{r}-{i}", tuple(prompt), stop=stop), sink)
        gateway.run_until_idle()
        for sink in sinks:
            if sink.result is None or sink.result.error or not sink.stamps:
                why = sink.result.error if sink.result is not None and sink.result.error else "no first token"
                raise SystemExit(f"a burst's request failed: {why}")
        if r:
            rounds.append(summary(start, [s.stamps for s in sinks]))
    return rounds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b", help="registry name (synthesized on first use)")
    p.add_argument("--model-path", help="an mlx-lm model directory instead")
    p.add_argument("--burst", type=int, default=32, help="requests sent at once")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds an arm, after one unmeasured round")
    p.add_argument("--tokens", type=int, default=2, help="max_tokens a request (above 2: the batch's decode too)")
    p.add_argument("--warmup", choices=("off", "quick", "full"), default="full", help="engine serve's warm-up")
    p.add_argument("--arms", default="served,gateway", help="comma-separated: served, gateway")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or set(arms) - {"served", "gateway"}:
        p.error(f"--arms takes served and gateway (got {args.arms!r})")
    if min(args.burst, args.rounds, args.tokens) < 1 or args.prompt_tokens < 3:
        p.error("--burst, --rounds and --tokens must be at least 1, --prompt-tokens at least 3")
    burst = Burst(args.burst, args.prompt_tokens, args.rounds, args.tokens)
    model_args = ["--model-path", args.model_path] if args.model_path else ["--model", args.model]
    medians = {}
    for arm in arms:
        if arm == "served":
            rounds = served_rounds(model_args, args.warmup, burst)
        else:
            rounds = gateway_rounds(None if args.model_path else args.model, args.model_path, args.warmup, burst)
        medians[arm] = report(arm, rounds)
    for arm, row in medians.items():
        line = (
            f"{arm}: median over {burst.rounds} rounds: TTFT p50 {row[0]:.0f} ms, p90 {row[1]:.0f}, last {row[2]:.0f}"
        )
        if len(row) > 3:
            line += f"; decode gap p50 {row[3]:.1f} ms, p90 {row[4]:.1f}, {row[5]:.0f} tok/s"
        print(line)
    if len(medians) == 2:
        ratios = [s / g for s, g in zip(medians["served"], medians["gateway"])]
        line = "served / gateway: p50 {:.2f}x, p90 {:.2f}x, last {:.2f}x".format(*ratios)
        if len(ratios) > 3:
            line += "; decode gap p50 {:.2f}x, p90 {:.2f}x, tok/s {:.2f}x".format(*ratios[3:])
        print(line)


if __name__ == "__main__":
    main()
