"""`harness spec`: speculative decoding against plain decoding on the same target, in process."""

from __future__ import annotations

from pathlib import Path

from harness.cli_common import CliError, status
from harness.cli_common import out as stdout
from harness.cli_common import positive as _positive


def add_spec(sub) -> None:
    p = sub.add_parser(
        "spec",
        help="speculative decoding vs plain decoding on one target (decode rate, acceptance, token identity)",
        description="Load the target once and run, per block, one frozen natural-text prompt on every arm in a "
        "rotating order: plain (the baseline), self (the target as its own draft: the acceptance upper bound), "
        "draft:NAME (a draft model with the target's tokenizer), ngram (prompt lookup), mtp (the target's "
        "Qwen3.5 MTP head). Prints median decode rate and TTFT, acceptance, tokens per target forward, "
        "replays per round, the paired ratio against plain, and whether each arm's tokens equal plain's.",
    )
    p.add_argument("--model", default="small-qwen35", help="registry name of the target (default small-qwen35)")
    p.add_argument(
        "--arms",
        default="plain,self,draft:small-qwen35-draft,ngram,mtp",
        help="comma-separated arms (default plain,self,draft:small-qwen35-draft,ngram,mtp)",
    )
    p.add_argument("--prompt-tokens", type=_positive, default=256, help="prompt length (default 256)")
    p.add_argument("--decode-tokens", type=_positive, default=128, help="tokens generated (default 128)")
    p.add_argument("--blocks", type=_positive, default=5, help="prompts, each run on every arm (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warmup requests per arm (default 1)")
    p.add_argument("--num-draft", type=_positive, default=3, help="drafts per round (default 3)")
    p.add_argument(
        "--policy",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="drafts per round: fixed = always --num-draft (default: what drafting costs and gives); "
        "adaptive = as `engine serve` does by default",
    )
    p.add_argument(
        "--rollback",
        choices=("trace", "replay"),
        default="trace",
        help="how recurrent layers undo rejected drafts (default trace; replay feeds kept tokens again)",
    )
    p.add_argument("--seed", type=int, default=0, help="first block's prompt seed (default 0)")
    p.add_argument(
        "--text",
        choices=("corpus", "held-out"),
        default=None,
        help="prompts from the project's corpus "
        "or from the trained models' held-out Python source (default: held-out for a trained target, "
        "corpus otherwise)",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--md", type=Path, help="write a Markdown table here")
    p.set_defaults(func=cmd_spec)


def cmd_spec(args) -> int:
    from engine.errors import UnknownModelError
    from engine.registry import get_spec
    from harness.spec_bench import SpecBenchConfig, markdown, parse_arms, run_spec_bench, write

    try:
        arms = parse_arms(args.arms, args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        trained = get_spec(args.model).tier == "trained"
    except UnknownModelError as e:
        raise CliError(str(e)) from None
    text = args.text or ("held-out" if trained else "corpus")
    cfg = SpecBenchConfig(
        args.prompt_tokens,
        args.decode_tokens,
        args.blocks,
        args.warmup,
        args.num_draft,
        rollback=args.rollback,
        policy=args.policy,
        seed=args.seed,
        text=text,
    )
    with status("loading") as progress:
        result = run_spec_bench(args.model, arms, cfg, on_progress=progress.update)
    write(result, args.json, args.md)
    stdout.print(markdown(result), markup=False, highlight=False)
    return 0 if all(all(a.same_tokens) for a in result.arms) else 1
