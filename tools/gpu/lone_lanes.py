"""A lone request's decode rate at each layer of the stack, in one process, in interleaved rounds.

    python3 -m tools.gpu.lone_lanes --model qwen27b --tokens 128 --rounds 3

Each round runs one greedy request (the same prompt) through, in turn:

    generate     engine.generate's loop (the serial lane's token loop, no gateway)
    runner       the continuous lane's BatchRunner at one row (decode buckets as `engine serve`), no scheduler
    serial       a Gateway with --batch 1 (the serial lane, prompt cache as `engine serve`)
    continuous   a Gateway as `engine serve` sets it up on this device (scheduler, batcher, prompt cache)

and prints each one's decode rate (tokens after the first over the time from the first to the last, as
the harness measures it), its ratio to `generate`, the median, 90th percentile and largest gap between
tokens (a device step that is slower throughout moves the median; host stalls move the tail), and the
time Python's garbage collector took meanwhile.
Where the served lone row is slower on the continuous lane than on the serial lane, the first layer at
which the rate drops is where the time goes; where none drops, it is above the gateway (the server's
threads). `--warmup full` first runs `engine serve`'s warm-up on the continuous gateway, `--burst N` then
sends N requests at once to it (as `harness startup` does before its lone rounds) and measures the
rounds again, `--reset` empties MLX's buffer cache and measures the rounds again, then the prompt caches
(with a garbage collection) and measures them once more, and `--second-model` loads the model again into the
same process and measures the rounds on it and then on the first model. MLX's active and cached memory is
printed before each phase's rounds.

    python3 -m tools.gpu.lone_lanes --model qwen27b --warmup full --burst 64 --reset --arms generate,continuous
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time


def _rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class Stamps:
    """A TokenSink that keeps the time of every token."""

    def __init__(self):
        self.stamps: list[float] = []
        self.result = None

    def on_start(self) -> None:
        pass

    def on_token(self, token) -> bool:
        self.stamps.append(time.perf_counter())
        return True

    def on_end(self, result) -> None:
        self.result = result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b", help="registry name (synthesized on first use)")
    p.add_argument("--model-path", help="an mlx-lm model directory instead")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="measured rounds after one warm-up round")
    p.add_argument("--arms", default="generate,runner,serial,continuous")
    p.add_argument(
        "--warmup",
        choices=("off", "quick", "full"),
        default="off",
        help="first run `engine serve`'s warm-up on the continuous gateway",
    )
    p.add_argument(
        "--warmup-passes",
        type=int,
        default=1,
        help="run the warm-up this many times: the later passes' "
        "stage times are what its requests cost with every shape and kernel already built",
    )
    p.add_argument(
        "--no-prebuild",
        action="store_true",
        help="the warm-up without its kernel-build stage (the "
        "decode steps' forwards built, not run, before any request): whether the steps it traces are slower",
    )
    p.add_argument("--burst", type=int, default=0, help="then a burst of this many requests, and the rounds again")
    p.add_argument(
        "--reset",
        action="store_true",
        help="last, empty the prompt caches and MLX's buffer cache, collect garbage, and run the rounds again",
    )
    p.add_argument(
        "--second-model",
        action="store_true",
        help="last, load the model again into this process (new "
        "compiled calls and launches, the same process state) and run the rounds on it, then on the first "
        "model again: whether what slows a warmed model is its own or the process's",
    )
    args = p.parse_args(argv)

    from tools.gpu.as_served import prepare_device

    prepare_device()  # before MLX compiles anything

    import mlx.core as mx

    from engine.batch.runner import BatchRunner, Joiner
    from engine.engine import Engine
    from engine.gateway import Gateway
    from engine.generate import generate
    from engine.loading import context_of
    from engine.request import GenerationRequest, SamplingParams, StopCriteria
    from engine.server.main import ServeConfig
    from engine.warmup import warm_up

    def load() -> dict:
        """A model and the gateways on it: what the arms run on."""
        engine = Engine.load(args.model if not args.model_path else None, args.model_path)
        tier = engine.kernels.tier
        return {
            "engine": engine,
            "gateways": {
                "serial": Gateway(engine.model, ServeConfig(batch=1).gateway_config(tier)),
                "continuous": Gateway(engine.model, ServeConfig().gateway_config(tier)),
            },
        }

    first = current = load()
    engine = first["engine"]
    tier = engine.kernels.tier
    prompt = [(7 * i + 11) % 1000 + 10 for i in range(args.prompt_tokens)]
    stop = StopCriteria(max_tokens=args.tokens, ignore_eos=True)
    continuous_cfg = first["gateways"]["continuous"].config

    def run_generate() -> list[float]:
        stamps = []
        for _ in generate(current["engine"].model, prompt, stop=stop):
            stamps.append(time.perf_counter())
        return stamps

    def run_runner() -> list[float]:
        runner = BatchRunner(
            current["engine"].model,
            decode_buckets=continuous_cfg.decode_buckets,
            chunk_buckets=continuous_cfg.prefill_buckets,
        )
        runner.add_joiners([Joiner("r", SamplingParams(), prompt)])
        runner.prefill([prompt[:-1]])
        runner.first_tokens(["r"])
        runner.join({"r"})
        stamps = [time.perf_counter()]
        for _ in range(args.tokens - 1):
            runner.decode()
            stamps.append(time.perf_counter())
        return stamps

    ids = itertools.count()

    def run_gateway(name: str) -> list[float]:
        sink = Stamps()
        gateway = current["gateways"][name]
        gateway.submit(GenerationRequest(f"{name}-{next(ids)}", tuple(prompt), SamplingParams(), stop), sink)
        gateway.run_until_idle()
        return sink.stamps

    arms = args.arms.split(",")
    gc_s = [0.0]
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            gc_s[0] += time.perf_counter() - started.pop()

    gc.callbacks.append(on_gc)

    def rounds(label: str, warm: bool) -> None:
        active, cached = mx.get_active_memory() / 2**30, mx.get_cache_memory() / 2**30
        print(f"{label}: MLX active {active:.2f} GiB, cache {cached:.2f} GiB", flush=True)
        rates: dict[str, list[float]] = {a: [] for a in arms}
        gaps: dict[str, list[float]] = {a: [] for a in arms}
        gcs: dict[str, float] = {a: 0.0 for a in arms}
        for rnd in range(args.rounds + warm):
            line = []
            for arm in arms:
                gc_s[0] = 0.0
                if arm == "generate":
                    stamps = run_generate()
                elif arm == "runner":
                    stamps = run_runner()
                else:
                    stamps = run_gateway(arm)
                rate = _rate(stamps)
                if rnd or not warm:
                    rates[arm].append(rate)
                    gaps[arm] += [b - a for a, b in zip(stamps, stamps[1:])]
                    gcs[arm] += gc_s[0]
                line.append(f"{arm} {rate:.1f}")
            print(
                f"{label} round {rnd}{' (warm-up)' if warm and rnd == 0 else ''}: " + ", ".join(line) + " tok/s",
                flush=True,
            )
        base = statistics.median(rates[arms[0]])
        for arm in arms:
            med = statistics.median(rates[arm])
            ms = sorted(1000 * g for g in gaps[arm])
            print(
                f"{label} {arm:>11}: median {med:.1f} tok/s ({1000 / med:.2f} ms a token), {med / base:.3f}x "
                f"{arms[0]}, gaps p50 {ms[len(ms) // 2]:.2f} p90 {ms[9 * len(ms) // 10]:.2f} max {ms[-1]:.2f} ms, "
                f"garbage collection {1000 * gcs[arm] / len(rates[arm]):.1f} ms a request"
            )

    if args.warmup != "off":
        for n in range(args.warmup_passes):
            start = time.perf_counter()
            warm_up(
                first["gateways"]["continuous"],
                args.warmup,
                context=context_of(engine.config),
                log=print,
                prebuild=not args.no_prebuild and n == 0,
            )
            print(f"warm-up {args.warmup} (pass {n + 1}): {time.perf_counter() - start:.1f} s", flush=True)
    rounds("fresh", warm=True)
    if args.burst:
        sinks, busy = [Stamps() for _ in range(args.burst)], first["gateways"]["continuous"]
        for i, sink in enumerate(sinks):
            rotated = tuple(prompt[i:] + prompt[:i])  # no request reuses another's prefix
            busy.submit(GenerationRequest(f"burst-{i}", rotated, SamplingParams(), stop), sink)
        start = time.perf_counter()
        busy.run_until_idle()
        print(
            f"burst of {args.burst}: {time.perf_counter() - start:.1f} s; MLX active "
            f"{mx.get_active_memory() / 2**30:.1f} GiB, cache {mx.get_cache_memory() / 2**30:.1f} GiB; garbage "
            f"collector counts {gc.get_count()}",
            flush=True,
        )
        rounds(f"after a burst of {args.burst}", warm=False)
    if args.reset:
        mx.clear_cache()
        rounds("MLX cache emptied", warm=False)
        for g in first["gateways"].values():
            if g.prompt_cache is not None:
                g.prompt_cache.clear()
        gc.collect()
        mx.clear_cache()
        rounds("reset", warm=False)
    if args.second_model:
        current = load()
        rounds("a second model", warm=True)
        current = first
        rounds("the first model again", warm=False)
    print(f"tier {tier}; continuous lane: {continuous_cfg}")


if __name__ == "__main__":
    main()
