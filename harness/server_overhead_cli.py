"""`harness server-overhead`: what HTTP costs, in-process generate against `engine serve`."""

from __future__ import annotations

import json

from harness.cli_common import console, measured_options, model_source, out, targets


def add_server_overhead(sub) -> None:
    so = sub.add_parser(
        "server-overhead",
        help="what HTTP costs: in-process generate vs `engine serve` (serial and continuous lanes)",
        description="On one artifact and the same prompt ids: greedy fixed-length requests in process, then "
        "streamed through `engine serve --batch 1` and `engine serve` (prompt cache off, one request at a "
        "time). Prints median TTFT and decode rate per arm and the ratio to in-process.",
    )
    model_source(so)
    measured_options(so, prompt_tokens=512, decode_tokens=128, samples=6, unit="rounds, one request per arm")
    so.set_defaults(func=cmd_server_overhead)


def cmd_server_overhead(args) -> int:
    from dataclasses import asdict

    from rich.table import Table

    from harness.parity import vocab_size
    from harness.server_overhead import OverheadConfig, measure, paired_decode_ratio

    cfg = OverheadConfig(args.prompt_tokens, args.decode_tokens, args.samples, args.warmup)
    table = Table(title=f"server overhead ({cfg.prompt_tokens} prompt, {cfg.decode_tokens} decode, greedy, cold)")
    for col in ("model", "arm", "TTFT ms", "ratio", "decode tok/s", "ratio", "paired", "range", "load s", "tokens"):
        table.add_column(col)
    records, identical = [], True
    for name, path in targets(args):
        console.print(f"{name}: in process, then through two servers ({cfg.samples} samples each) ...")
        arms = measure(path, vocab_size(path), cfg, log=lambda m, name=name: console.print(f"{name}: {m}"))
        base = arms[0]
        for arm in arms:
            same = arm.tokens == base.tokens
            identical &= same
            table.add_row(
                name,
                arm.arm,
                f"{arm.median_ttft_ms:.1f}",
                f"{arm.median_ttft_ms / base.median_ttft_ms:.3f}",
                f"{arm.median_decode_tps:.1f}",
                f"{arm.median_decode_tps / base.median_decode_tps:.3f}",
                f"{paired_decode_ratio(arm, base):.3f}",
                f"{min(arm.decode_tps):.1f}-{max(arm.decode_tps):.1f}",
                f"{arm.load_to_ready_s:.1f}" if arm.load_to_ready_s else "-",
                "identical" if same else "[red]DIFFER[/]",
            )
            records.append({"model": name, **asdict(arm)})
    out.print(table)
    out.print(
        "medians; ratio = arm / in-process; paired: geometric mean of per-round decode ratios (arms "
        "alternate within each round); TTFT through a server is measured by the client (request sent -> "
        "first token event)"
    )
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    return 0 if identical else 1
