"""What a prompt-cache lookup costs the engine's thread with many entries: entries that share a system prompt
(each its own tail, block snapshots every 256 tokens, as a hybrid model's), looked up by prompts that share it
too and by prompts that share nothing.

    python3 -m tools.prompt_cache_lookup --entries 1000 --shared 600 --tail 200

The caches are stand-ins (the lookup never reads them, and copying them for a hit costs next to nothing here): the time is
choosing the entry, as `PromptCache.lookup` does it for every request before its prefill.
"""

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from engine.cache.prompt_cache import PromptCache
from engine.request import CachedPrefix


@dataclass
class StandIn:
    """A recurrent layer's cache as the prompt cache sees it: cannot rewind, has a size."""

    nbytes: int = 1

    def is_trimmable(self) -> bool:
        return False


def lookup_ms(cache: PromptCache, prompts: list[tuple[int, ...]]) -> float:
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        cache.lookup(prompt)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1000, help="entries in the cache")
    p.add_argument("--shared", type=int, default=600, help="tokens of the system prompt every entry starts with")
    p.add_argument("--tail", type=int, default=200, help="each entry's own tokens after it")
    p.add_argument("--lookups", type=int, default=50, help="lookups of each kind timed")
    args = p.parse_args(argv)
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(150_000) for _ in range(n)]

    system = tokens(args.shared)
    cache = PromptCache(max_bytes=1 << 62)
    for _ in range(args.entries):
        key = tuple(system + tokens(args.tail))
        blocks = tuple((n, [StandIn()]) for n in range(256, len(key), 256))
        cache.insert(CachedPrefix(key, [StandIn()], blocks))
    sharing = [tuple(system + tokens(args.tail)) for _ in range(args.lookups)]
    unrelated = [tuple(tokens(args.shared + args.tail)) for _ in range(args.lookups)]
    print(f"{len(cache)} entries of {args.shared} shared + {args.tail} own tokens")
    print(f"a prompt sharing the system prompt: {lookup_ms(cache, sharing):.3f} ms a lookup")
    print(f"a prompt sharing nothing:           {lookup_ms(cache, unrelated):.3f} ms a lookup")


if __name__ == "__main__":
    main()
