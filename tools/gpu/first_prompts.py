"""The first prompts after ready against the ones that follow, in one process, and whether MLX's buffer cache
or compilation is what the first ones pay for.

    python3 -m tools.gpu.first_prompts --model qwen27b --warmup full --lengths 1024,4096 --repeats 3

As `engine serve` starts (kernel cache, MLX cache limit, the continuous gateway at its defaults for the tier,
the warm-up, then `gc.collect()` and `mx.clear_cache()`), then three phases, each a prompt of every length
and then `--repeats` more of each (every prompt its own tokens: none starts from another's cached prefix),
max_tokens 2, TTFT from submit to the first token:

    after ready       what a client meets: the first prompts, then the same lengths again
    cache emptied     MLX's buffer cache emptied again, nothing compiled since: if the first prompts are slow
                      again, they pay for allocating their buffers, not for compiling
    refilled          emptied, then one prompt of `--refill` tokens through, then the prompts: whether one
                      forward after the warm-up gives the first prompts the buffers they would allocate

Each line: the length, the first prompt's TTFT, the median of the repeats, their ratio, and MLX's cached
bytes before the phase.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b", help="registry name (synthesized on first use)")
    p.add_argument("--model-path", help="an mlx-lm model directory instead")
    p.add_argument("--warmup", choices=("off", "quick", "full"), default="full", help="engine serve's warm-up")
    p.add_argument("--lengths", default="1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="prompts of each length after the first")
    p.add_argument("--refill", type=int, default=2048, help="the refilled phase's one prompt, in tokens")
    p.add_argument(
        "--prompt-cache-block",
        type=int,
        help="engine serve's --prompt-cache-block (default: its default; 0 with --prompt-cache-bytes 0 times the "
        "prefills with the prompt cache off)",
    )
    p.add_argument("--prompt-cache-bytes", type=int, help="engine serve's --prompt-cache-bytes (default: its default)")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]

    from tools.gpu.as_served import prepare_device

    prepare_device()  # before MLX compiles anything

    import mlx.core as mx

    from engine.request import GenerationRequest, StopCriteria
    from engine.server.main import ServeConfig
    from tools.gpu.as_served import warmed_gateway
    from tools.gpu.lone_lanes import Stamps

    cache = {"prompt_cache_block": args.prompt_cache_block, "prompt_cache_bytes": args.prompt_cache_bytes}
    serve = ServeConfig(**{k: v for k, v in cache.items() if v is not None})
    model = args.model if not args.model_path else None
    engine, gateway, seconds = warmed_gateway(
        model, args.model_path, args.warmup, serve, log=lambda line: print(line, flush=True)
    )
    print(
        f"warm-up {args.warmup}: {seconds:.1f} s, kernels {engine.kernels.tier}, prompt cache "
        f"{serve.prompt_cache_bytes} bytes, blocks of {serve.prompt_cache_block}",
        flush=True,
    )

    ids = itertools.count()

    def ttft(n: int) -> float:
        """One prompt of n tokens (its own: opened by a token no other prompt has there), max_tokens 2."""
        i = next(ids)
        prompt = (5 + i % 50, 60 + i // 50, *((7 * j + 11 * i) % 900 + 10 for j in range(n - 2)))
        sink, sent = Stamps(), time.perf_counter()
        gateway.submit(GenerationRequest(f"p{i}", prompt, stop=StopCriteria(max_tokens=2, ignore_eos=True)), sink)
        gateway.run_until_idle()
        if sink.result is None or sink.result.error:
            raise SystemExit(f"a {n}-token prompt failed: {sink.result.error if sink.result else 'no result'}")
        return (sink.stamps[0] - sent) * 1e3

    def phase(label: str) -> None:
        cached = mx.get_cache_memory() / 2**30
        firsts = {n: ttft(n) for n in lengths}
        for n in lengths:
            later = statistics.median(ttft(n) for _ in range(args.repeats))
            print(
                f"{label}: {n} tokens: first {firsts[n]:.0f} ms, then {later:.0f} ms (median of {args.repeats}), "
                f"{firsts[n] / later:.2f}x; MLX cache before {cached:.2f} GiB",
                flush=True,
            )

    phase("after ready")
    gc.collect()
    mx.clear_cache()
    phase("cache emptied")
    gc.collect()
    mx.clear_cache()
    ttft(args.refill)
    phase(f"refilled ({args.refill} tokens)")


if __name__ == "__main__":
    main()
