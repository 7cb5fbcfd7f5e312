"""Scored prompts on running servers, as lm-eval's loglikelihood tasks send them: `echo`, `logprobs: 1`,
`max_tokens: 1`, a list of token-id prompts in one request. Times them against the same prompts unscored, and
with `--reference URL` (e.g. an `engine serve --kernels exact` on the same artifact) compares the prompt
logprobs and which tokens were the greedy ones.

    python3 -m tools.gpu.scored_prompts --url http://127.0.0.1:8000 --reference http://127.0.0.1:8001 \\
        --prompts 4 --tokens 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def prompts(count: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(tokens)] for _ in range(count)]  # noqa: S311


def post(client: httpx.Client, body: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return r.json(), seconds


def scored(client: httpx.Client, batch: list[list[int]]) -> tuple[list[list[float]], list[list[bool]], float]:
    """Each prompt's token logprobs (tokens 1.., the generated one left out) and whether each was the top
    alternative, and the request's seconds."""
    reply, seconds = post(client, {"prompt": batch, "echo": True, "logprobs": 1, "max_tokens": 1})
    lps, greedy = [], []
    for choice in sorted(reply["choices"], key=lambda c: c["index"]):
        values = choice["logprobs"]["token_logprobs"][1:-1]
        tops = choice["logprobs"]["top_logprobs"][1:-1]
        lps.append(values)
        greedy.append([v >= max(top.values()) for v, top in zip(values, tops)])
    return lps, greedy, seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server measured")
    p.add_argument("--reference", default=None, help="a server whose prompt logprobs the first is compared with")
    p.add_argument("--prompts", type=int, default=4, help="prompts in one request (lm-eval's --batch_size)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens a prompt")
    p.add_argument("--rounds", type=int, default=3, help="scored and plain requests each, alternating")
    p.add_argument("--vocab", type=int, default=30000, help="prompt token ids are drawn from [10, VOCAB)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    client = httpx.Client(base_url=args.url, timeout=1800)
    times = {"scored": [], "plain": []}
    for n in range(args.rounds):  # fresh prompts each time: nothing from the prompt cache
        times["scored"].append(scored(client, prompts(args.prompts, args.tokens, args.vocab, seed=2 * n + 1))[2])
        plain = {"prompt": prompts(args.prompts, args.tokens, args.vocab, seed=2 * n + 2), "max_tokens": 1}
        times["plain"].append(post(client, plain)[1])
    record = {
        "prompts": args.prompts,
        "tokens": args.tokens,
        **{f"{k}_s": [round(s, 3) for s in v] for k, v in times.items()},
    }
    tokens = args.prompts * args.tokens
    for kind, seconds in times.items():
        print(
            f"{kind}: {args.prompts} x {args.tokens} tokens in {statistics.median(seconds):.3f} s median "
            f"({tokens / statistics.median(seconds):,.0f} prompt tok/s; {', '.join(f'{s:.3f}' for s in seconds)})"
        )
    if args.reference:
        batch = prompts(args.prompts, args.tokens, args.vocab)
        ours, our_greedy, _ = scored(client, batch)
        theirs, their_greedy, _ = scored(httpx.Client(base_url=args.reference, timeout=1800), batch)
        diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
        same = sum(a == b for x, y in zip(our_greedy, their_greedy) for a, b in zip(x, y))
        sums = [(sum(x), sum(y)) for x, y in zip(ours, theirs)]
        record.update(
            mean_abs_diff=statistics.fmean(diffs),
            max_abs_diff=max(diffs),
            greedy_agreement=same / len(diffs),
            loglikelihoods=sums,
        )
        print(
            f"against the reference: mean |diff| {record['mean_abs_diff']:.2e}, max {record['max_abs_diff']:.2e}, "
            f"greedy flags agree {100 * record['greedy_agreement']:.1f}%; each prompt's sum "
            + "; ".join(f"{a:.2f} vs {b:.2f}" for a, b in sums)
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
