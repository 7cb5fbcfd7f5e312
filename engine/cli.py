"""`engine`: run the inference engine from the command line.

    engine generate --model tiny-qwen35 --prompt "Hello" --max-tokens 32
    engine generate --model-path ~/models/Qwen3-4B-4bit --chat --prompt "Hi"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from engine.errors import USER_ERRORS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="An LLM inference engine on MLX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt and print it, then a line of timing to stderr. "
        "Registry names are synthesized on first use (see `harness models list`).",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="registry name, e.g. tiny-qwen35 or qwen27b")
    src.add_argument("--model-path", type=Path, help="an mlx-lm model directory")
    gen.add_argument("--seed", type=int, default=0, help="artifact seed for registry models (default 0)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="seed for sampling (default: random)")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    gen.set_defaults(func=cmd_generate)
    return parser


def cmd_generate(args) -> int:
    from engine.engine import Engine
    from engine.types import SamplingParams

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    eng = Engine.load(args.model, args.model_path, seed=args.seed)
    tok = eng.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed
    )
    sampling.validate(tok.vocab_size)
    start = time.perf_counter()
    first_at, out_ids, finish = None, [], None
    for t in eng.generate(ids, max_tokens=args.max_tokens, sampling=sampling, ignore_eos=args.ignore_eos):
        first_at = first_at or time.perf_counter()
        finish = t.finish_reason
        if not t.is_stop:
            out_ids.append(t.token_id)
    end = time.perf_counter()
    print(tok.decode(out_ids))
    decode_tps = (len(out_ids) - 1) / (end - first_at) if len(out_ids) > 1 and first_at else float("nan")
    print(
        f"[{len(ids)} prompt tokens, {len(out_ids)} generated, TTFT {(first_at - start) * 1000:.0f} ms, "
        f"decode {decode_tps:.1f} tok/s, finish: {finish.value if finish else '-'}]",
        file=sys.stderr,
    )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
