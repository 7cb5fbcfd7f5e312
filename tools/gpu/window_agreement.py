"""How often a verify window picks another token than the decode steps it stands for, and how close the race is.

    python3 -m tools.gpu.window_agreement --model qwen27b --tokens 64 --window 4

One row: the model prefills a random prompt, then decodes `--tokens` greedy tokens one step at a time
(the logits of each step kept). The same tokens are then fed again from a fresh prefill as windows of
`--window` tokens, as a speculative verify forward feeds drafts: traced (the recurrent state after each
token recorded, the fast tier's window step) and untraced (the layers' own multi-token path). For each
it prints at how many positions the window's argmax differs from the step's, and the largest logit
difference between them; beside it the steps' top-1 minus top-2 logit margins. Where the margins sit
below the difference, the two paths disagree by rounding alone, and a draft that decodes by steps is
rejected by a window that rounds otherwise (a self-draft's acceptance under 100%).
"""

from __future__ import annotations

import argparse
import statistics


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def measure(model_name: str, tokens: int, window: int, prompt_tokens: int, tier: str) -> None:
    import mlx.core as mx

    from engine.engine import Engine
    from engine.kernels import KernelConfig
    from engine.loading import text_config

    eng = Engine.load(model_name, with_tokenizer=False, kernels=KernelConfig.from_env(tier))
    model = eng.model
    vocab = min(30000, int(text_config(eng.config)["vocab_size"]))
    prompt = mx.random.randint(10, vocab, (1, prompt_tokens), key=mx.random.key(0))

    def prefilled():
        cache = eng.make_cache()
        logits = model(prompt, cache)[:, -1].astype(mx.float32)
        mx.eval(logits)
        return cache, logits

    cache, last = prefilled()
    steps, toks = [last], [int(mx.argmax(last).item())]
    for _ in range(tokens):
        last = model(mx.array([[toks[-1]]]), cache)[:, -1].astype(mx.float32)
        mx.eval(last)
        steps.append(last)
        toks.append(int(mx.argmax(last).item()))
    margins = [(lambda top: (top[1] - top[0]).item())(mx.sort(s[0])[-2:]) for s in steps]
    print(
        f"{model_name} ({tier}), {tokens} greedy steps after a {prompt_tokens}-token prompt: top-1 minus top-2 "
        f"logit margin p10 {_pct(margins, 0.1):.4f}, median {statistics.median(margins):.4f}; largest |logit| "
        f"{mx.abs(steps[0]).max().item():.1f}"
    )
    usable = tokens - tokens % window
    for traced in (True, False):
        cache, _ = prefilled()
        differ, gaps = 0, []
        for at in range(0, usable, window):
            recurrent = [c for c in cache if hasattr(c, "start_trace")] if traced else []
            for c in recurrent:
                c.start_trace()
            out = model(mx.array([toks[at : at + window]]), cache).astype(mx.float32)
            mx.eval(out)
            for c in recurrent:
                c.keep_traced(window)
            for j in range(window):
                gaps.append(mx.abs(out[:, j] - steps[at + j + 1]).max().item())
                differ += int(mx.argmax(out[0, j]).item() != toks[at + j + 1])
        label = "traced (the window step)" if traced else "untraced (the layers' own path)"
        print(
            f"windows of {window}, {label}: argmax differs from the step's at {differ}/{usable}; largest logit "
            f"difference median {statistics.median(gaps):.4f}, max {max(gaps):.4f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen27b", help="registry name (synthesized on first use)")
    p.add_argument("--tokens", type=int, default=64, help="greedy decode steps (default 64)")
    p.add_argument("--window", type=int, default=4, help="tokens a verify window (default 4: 3 drafts)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--tier", default="fast", help="kernel tier (fast, exact, auto)")
    args = p.parse_args()
    measure(args.model, args.tokens, args.window, args.prompt_tokens, args.tier)


if __name__ == "__main__":
    main()
