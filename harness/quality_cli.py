"""`harness quality`: held-out perplexity and KL against the reference for weight quantizations, quantized KV
and kernel tiers, in process."""

from __future__ import annotations

import json
from pathlib import Path

from harness.cli_common import CliError, csv_ints, model_source, positive, status, targets
from harness.cli_common import out as stdout


def add_quality(sub) -> None:
    p = sub.add_parser(
        "quality",
        help="held-out perplexity and KL vs the reference for weight bits, KV bits and kernel tiers",
        description="Score each model on held-out text (oracles.train_data's held-out files, in the model's own "
        "tokenizer): perplexity, and the mean KL divergence and top-1 agreement of every position's next-token "
        "distribution against the reference (the artifact on the exact tier). Variants: the reference with a "
        "quantized KV cache (--kv-bits), an unquantized artifact quantized in memory (--weight-bits, affine, group "
        "64), and the fast tier where the device runs it. Windows start from an empty cache and go through the "
        "model in chunks, as prompts are prefilled.",
    )
    model_source(p)
    p.add_argument("--seed", type=int, default=0, help="artifact seed of synthesized models (default 0)")
    p.add_argument("--tokens", type=positive, default=4096, help="held-out tokens scored (default 4096)")
    p.add_argument(
        "--window", type=positive, default=512, help="tokens a window, each from an empty cache (default 512)"
    )
    p.add_argument("--chunk", type=positive, default=128, help="tokens a forward within a window (default 128)")
    p.add_argument(
        "--weight-bits",
        type=_bits,
        default=[8, 4],
        help="in-memory weight quantizations of an unquantized artifact (default 8,4; '' for none)",
    )
    p.add_argument("--kv-bits", type=_bits, default=[8, 4], help="quantized KV caches (default 8,4; '' for none)")
    p.add_argument(
        "--kv-group-size",
        type=positive,
        default=64,
        help="quantized KV's group size (default 64; it must divide the head size)",
    )
    p.add_argument("--no-fast", action="store_true", help="skip the fast tier even where the device runs it")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--md", type=Path, help="also write a Markdown table here")
    p.set_defaults(func=cmd_quality)


def _bits(value: str) -> list[int]:
    """Comma-separated bit widths; '' for none."""
    return csv_ints(value) if value.strip() else []


def cmd_quality(args) -> int:
    from harness.quality import QualitySettings, markdown, measure

    if set(args.kv_bits) - {4, 8}:
        raise CliError(f"--kv-bits takes 4 and 8 (quantized KV caches), got {','.join(map(str, args.kv_bits))}")
    if set(args.weight_bits) - {2, 3, 4, 5, 6, 8}:
        raise CliError(f"--weight-bits takes 2, 3, 4, 5, 6 and 8, got {','.join(map(str, args.weight_bits))}")
    settings = QualitySettings(
        tokens=args.tokens, window=args.window, chunk=args.chunk, kv_group_size=args.kv_group_size
    )
    results = []
    for label, path in targets(args):
        with status(f"{label}: loading") as progress:

            def say(line: str, label: str = label) -> None:
                progress.update(f"{label}: {line}")

            try:
                results.append(measure(label, path, settings, args.weight_bits, args.kv_bits, not args.no_fast, say))
            except ValueError as e:  # a setting the model cannot take (KV group size, too little held-out text)
                raise CliError(f"{label}: {e}") from None
    table = markdown(results)
    if args.json:
        args.json.write_text(json.dumps([r.as_json() for r in results], indent=2) + "\n")
    if args.md:
        args.md.write_text(table)
    stdout.print(table, markup=False, highlight=False)
    return 0
