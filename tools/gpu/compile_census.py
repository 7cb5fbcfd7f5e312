"""What MLX compiles when the continuous batcher meets a shape it has not met, and what each costs.

    python3 -m tools.gpu.compile_census --model qwen27b --waves 1,1,2,3,4,8,9,16 --tokens 8 --grow 300

MLX's CUDA backend writes every module it compiles to MLX_PTX_CACHE_DIR; this points that at an empty
directory before MLX starts, then drives a ContinuousBatcher through waves of requests (a wave of N
prompts submitted together, `--tokens` tokens each, prompts of `--prompt-tokens`), then one request for
`--grow` tokens (its caches grow past their allocation steps), with the buckets `engine serve` would use
(`--no-buckets`: none). Every batcher step that wrote modules is printed: its wall time, what it ran
(decode rows and ghosts, prefill group and chunk, token 0), and the modules by name, so a wave that
repeats an earlier shape shows none. The end sums the compile time (the steps'
time less the same kind of step's median time without new modules) by kind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def modules(cache: Path) -> set[str]:
    return {p.name for p in cache.rglob("*") if p.is_file()}


def short(names: set[str], width: int = 70) -> str:
    counts = defaultdict(int)
    for name in names:
        counts[name.split(".")[0][:width]] += 1
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(counts.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b")
    p.add_argument("--kernels", default="fast", choices=("auto", "exact", "fast"))
    p.add_argument("--waves", default="1,1,2,3,4,8,9,16", help="requests submitted together, wave after wave")
    p.add_argument("--tokens", type=int, default=8, help="tokens each wave's requests generate (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--grow", type=int, default=300, help="tokens of one last request (0: none)")
    p.add_argument("--batch", type=int, default=64, help="the batcher's row cap (default 64)")
    p.add_argument(
        "--no-buckets",
        dest="buckets",
        action="store_false",
        help="no decode or chunk buckets (default: what engine serve's auto gives the tier)",
    )
    args = p.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="mlx-ptx-census-"))
    os.environ["MLX_PTX_CACHE_DIR"] = str(cache)  # before MLX's first compilation

    import mlx.core as mx

    from engine.batch.batcher import ContinuousBatcher
    from engine.batch.scheduler import SchedulerConfig
    from engine.engine import Engine
    from engine.kernels import KernelConfig
    from engine.request import GenerationRequest, StopCriteria
    from engine.server.main import ServeConfig
    from engine.sinks import CollectingSink

    eng = Engine.load(args.model, with_tokenizer=False, kernels=KernelConfig.from_env(args.kernels))
    gw = ServeConfig(
        batch=args.batch, decode_buckets=None if args.buckets else (), prefill_buckets=None if args.buckets else ()
    ).gateway_config(eng.kernels.tier)
    batcher = ContinuousBatcher(
        eng.model,
        SchedulerConfig(max_rows=gw.batch, prefill_chunk=gw.prefill_chunk),
        decode_buckets=gw.decode_buckets,
        chunk_buckets=gw.prefill_buckets,
    )
    print(
        f"{args.model}: kernels {eng.kernels.tier}; decode buckets {gw.decode_buckets or 'off'}, chunk buckets "
        f"{gw.prefill_buckets or 'off'}; MLX_PTX_CACHE_DIR={cache}",
        flush=True,
    )
    seen, quiet, costly = modules(cache), defaultdict(list), defaultdict(list)
    serial = 0

    def what() -> str:
        s = batcher.scheduler
        chunks = [len(q.prompt_body) - q.prefilled for q in s.joiners]
        ghosts = f" (+{batcher.runner.ghosts})" if batcher.runner.ghosts else ""
        return (
            f"decode {len(s.running)}{ghosts} rows" * bool(s.running) + f" | joiners {len(s.joiners)}"
            f" (left {max(chunks, default=0)})" * bool(s.joiners) + f" | queued {len(s.pending)}" * bool(s.pending)
        )

    def run(label: str, n: int, tokens: int) -> None:
        nonlocal seen, serial
        for _ in range(n):
            serial += 1
            prompt = tuple((serial * 7919 + i * 104729) % 50000 + 10 for i in range(args.prompt_tokens))
            batcher.submit(
                GenerationRequest(f"r{serial}", prompt, stop=StopCriteria(max_tokens=tokens, ignore_eos=True)),
                CollectingSink(),
            )
        while batcher.has_work:
            kind = what()
            mx.synchronize()
            start = time.perf_counter()
            batcher.step()
            mx.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            now = modules(cache)
            new = now - seen
            seen = now
            key = kind.split(" | ")[0]
            if new:
                costly[key].append(ms)
                print(f"{label}: {ms:9.1f} ms  {kind}: {len(new)} modules: {short(new)}", flush=True)
            else:
                quiet[key].append(ms)

    start = time.perf_counter()
    for i, n in enumerate(int(v) for v in args.waves.split(",")):
        run(f"wave {i} ({n})", n, args.tokens)
    if args.grow:
        run(f"grow ({args.grow} tokens)", 1, args.grow)
    print(f"\n{len(seen)} modules in {time.perf_counter() - start:.1f} s", flush=True)
    for key in sorted(set(costly) | set(quiet)):
        base = statistics.median(quiet[key]) if quiet.get(key) else 0.0
        extra = sum(ms - base for ms in costly.get(key, []))
        print(
            f"{key or 'prefill only':30s} {len(costly.get(key, [])):4d} steps with new modules, ~{extra / 1e3:6.1f} s "
            f"above the median step without ({base:.1f} ms; {len(quiet.get(key, []))} steps)"
        )


if __name__ == "__main__":
    main()
