"""`harness run all` and `harness trials` (options, the dry run, progress, the summary at the end) and
`harness workloads` (the standard frozen workloads, written to goldens/workloads/)."""

from __future__ import annotations

import argparse
import json
import signal
import textwrap
import time
from dataclasses import replace
from pathlib import Path

from rich import box
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.model_source import resolve_model_dir
from engine.registry import get_spec
from engine.synth import artifact_dir, is_cached
from harness.cli_common import (
    CliError,
    console,
    csv,
    csv_ints,
    db_option,
    model_source,
    non_negative,
    positive,
    positive_float,
    positive_seconds,
    seed_option,
    share,
    targets,
)
from harness.cli_common import out as stdout
from harness.run import cells, preflight, summary
from harness.run.anomalies import flagged_lines
from harness.run.arms import external_arm, parse_arm_options, resolve_arms
from harness.run.arrivals import SWEEP_START, sweep_rates
from harness.run.interrupts import Interrupts
from harness.run.metrics import SLO_METRICS
from harness.run.runner import Runner, RunSettings, blocks_of, progress_steps
from harness.run.vllm_export import export
from harness.run.workloads import STANDARD, WorkloadSettings, build, golden_path, load_or_build, save, tokenizer_for

RECHECK_S = 0.25  # the preflight check after every cell: CPU use sampled over this long
# With no --models and no --model-path: a set that finishes in a few minutes on 2 CPU cores.
DEFAULT_CPU_MODELS = ["small-qwen3"]
DEFAULT_CPU_TOKENS = 64  # and no long-context phase, unless --tokens / --context say otherwise


def add_run(sub) -> None:
    run = sub.add_parser(
        "run",
        help="the benchmark: real servers (ours and stock mlx_lm.server), frozen workloads, SQLite + JSON",
        description="`harness run all`: for each model, start every arm as a real server process on the same "
        "artifact, replay the frozen token-ID workload through it (warmup, greedy parity probe, decode x5, cold "
        "and warm TTFT, aggregate throughput at each concurrency, long context), sample the server's RSS, and "
        "record everything to a JSON companion (after every cell) and an SQLite database. Refuses a loaded "
        "machine unless --diagnostic.",
    )
    run.add_argument("what", choices=["all"], help="`all`: every phase")
    add_options(run)
    run.add_argument(
        "--cell-repeats",
        type=positive,
        default=1,
        metavar="N",
        help="measure each concurrency and rate cell N times: after the run's block, N-1 blocks start "
        "every arm again in alternating order and repeat its warm-up and those cells; an aggregate rate's "
        "ratio then has an interval from the repetitions (one burst has none; default 1)",
    )
    run.set_defaults(func=cmd_run)


def add_trials(sub) -> None:
    tr = sub.add_parser(
        "trials",
        help="paired blocks for A-vs-B claims: one workload seed per block, arm order alternating",
        description="Run --seeds blocks; block i uses workload seed i and runs the arms in the given order "
        "(even blocks) or reversed (odd blocks), all into one JSON for `harness report`.",
    )
    add_options(tr, arms_default="engine,mlx-lm")
    tr.add_argument("--seeds", type=positive, default=5, help="blocks, one workload seed each (default 5)")
    tr.set_defaults(func=cmd_trials)


def add_options(p: argparse.ArgumentParser, arms_default: str = "engine,engine-serial,mlx-lm") -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--models",
        type=csv,
        help=f"registry names (default: the CPU set, {','.join(DEFAULT_CPU_MODELS)}, "
        f"with --tokens {DEFAULT_CPU_TOKENS} and no long-context phase unless given)",
    )
    src.add_argument("--model-path", type=Path, help="an mlx-lm model directory")
    p.add_argument("--label", help="name for --model-path in the records (default: the directory name)")
    p.add_argument(
        "--arms",
        type=arm_names,
        default=csv(arms_default),
        help=f"arms the harness starts, from engine, engine-serial, engine-exact, engine-fast (--kernels "
        f"exact|fast), engine-spec (n-gram speculation in the batch: --draft-kind ngram --spec-batch), mlx-lm "
        f"(default {arms_default}); '' for none, so that only the --arm servers are "
        "measured; a NAME an --arm gives places that server in the order",
    )
    p.add_argument(
        "--arm-args",
        action="append",
        default=[],
        metavar="ARM=OPTIONS",
        help="server options for one arm, appended to its command line (recorded with the run); "
        "repeat for more arms, e.g. --arm-args 'engine=--batch 64'; an arm engine-NAME that is not a "
        "standard one is engine serve with these options, e.g. --arms engine,engine-ngram --arm-args "
        "'engine-ngram=--draft-kind ngram'",
    )
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also measure a running OpenAI-compatible server the harness did not start (vLLM, "
        "llama-server, another engine serve), e.g. --arm vllm=http://127.0.0.1:8000: its model id "
        "from /v1/models goes into every request; repeatable. Measured after the --arms arms; alone "
        "with --arms '' --arm vllm=URL",
    )
    p.add_argument(
        "--nonce",
        type=hex_nonce,
        default=None,
        metavar="HEX",
        help="the run's nonce: every prompt sent to an --arm server but the probe opens with hex drawn "
        "from it, so that none is in a cache an earlier run filled (default: random; recorded as "
        "settings.run_nonce in the JSON); an earlier run's sends its prompts again",
    )
    p.add_argument(
        "--export",
        choices=["vllm"],
        action="append",
        default=[],
        help="also write the timed cells in another tool's result format: vllm (vllm bench serve's "
        "keys) to OUT with .vllm.json",
    )
    p.add_argument("--tokens", type=positive, default=None, help="output tokens per timed request (default 192)")
    ctx = p.add_mutually_exclusive_group()
    ctx.add_argument("--context", type=positive, default=None, help="long-context prompt tokens (default 4096)")
    ctx.add_argument("--skip-context", action="store_true", help="no long-context phase")
    p.add_argument("--concurrency", type=csv_ints, default=[4, 8], help="concurrent streams (default 4,8)")
    p.add_argument("--decode-samples", type=positive, default=5, help="decode requests (default 5)")
    p.add_argument(
        "--rates",
        type=rates,
        default=(),
        metavar="R,R,...|sweep",
        help="open-loop cells: requests arriving at R requests/s each, or 'sweep' "
        "('sweep:START'): START (1), twice that, ... 8 rates at most, until the arm saturates (throughput "
        "stops rising while TTFT climbs); each cell leaves its first and last tenth out of its metrics",
    )
    p.add_argument("--rate-requests", type=positive, default=32, metavar="N", help="requests a rate cell (default 32)")
    p.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="rate cells' arrival gaps: gamma of this shape (1: Poisson, the default; below 1 burstier)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive,
        default=None,
        metavar="N",
        help="rate cells: at most N requests in flight; later arrivals wait (default: no limit)",
    )
    p.add_argument(
        "--slo-target",
        type=share,
        default=0.9,
        metavar="SHARE",
        help="with --goodput and --rates: the summary names the highest rate whose SLO attainment "
        "stays at or above this share (default 0.9)",
    )
    p.add_argument(
        "--prefix-groups",
        type=non_negative,
        default=0,
        metavar="G",
        help="a shared-prefix cell: G groups of --prefix-group-size requests, each group on a system "
        "prompt of its own (--prefix-tokens) plus a suffix a request; 0: none (default)",
    )
    p.add_argument("--prefix-group-size", type=positive, default=4, metavar="N", help="requests a group (default 4)")
    p.add_argument(
        "--chats",
        type=non_negative,
        default=0,
        metavar="C",
        help="a multi-turn cell: C chats side by side through /v1/chat/completions, each of "
        "--turns turns whose messages are the conversation so far (canned replies) and a new user "
        "message; 0: none (default)",
    )
    p.add_argument("--turns", type=positive, default=4, metavar="T", help="turns a chat (default 4)")
    p.add_argument(
        "--prefix-tokens",
        type=positive,
        default=512,
        metavar="P",
        help="tokens of each group's shared system prompt (default 512)",
    )
    p.add_argument(
        "--chat-requests",
        type=non_negative,
        default=0,
        metavar="N",
        help="a chat cell: N single-turn chats through /v1/chat/completions, one at a time, timed as the "
        "decode cell is (--tokens); the servers' templates make the prompts, and the first reply and its "
        "prompt tokens are compared across arms (the chat probe); 0: none (default)",
    )
    for option in cells.options(cells.WORKLOAD) + cells.options(cells.RUN):  # those a kind of cell declares
        p.add_argument(
            option.flag,
            dest=option.dest,
            type=option.type,
            default=option.default,
            metavar=option.metavar,
            help=option.help,
        )
    p.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs, e.g. --goodput ttft:2000 tpot:50 (metrics ttft, tpot, e2el; ms): a request meeting all "
        "counts toward each cell's goodput (requests/s) and SLO attainment (vLLM's definition)",
    )
    p.add_argument(
        "--quality-tokens",
        type=non_negative,
        default=512,
        metavar="N",
        help="each engine arm's held-out perplexity, on the tier its server ran, once the server has stopped, over "
        "the first N held-out tokens (harness quality's text; 0: none; default 512)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive_seconds,
        default=1800,
        metavar="SECONDS",
        help="the longest one request may take, start to last byte; past it the request fails "
        "(timed_out) and its cell fails, not retried (default 1800)",
    )
    p.add_argument(
        "--stall-timeout",
        type=positive_seconds,
        default=300,
        metavar="SECONDS",
        help="the longest a request may go without a byte (connecting, sending, or waiting for the next "
        "one); past it the server is taken as hung: the cell fails (stalled) with its stderr tail, the "
        "server is stopped and the run goes on with the next arm (default 300)",
    )
    p.add_argument("--workload-seed", type=int, default=0, help="workload seed (default 0)")
    seed_option(p)
    p.add_argument("--out", type=Path, help="JSON companion (default reports/run-<time>.json)")
    db_option(p)
    p.add_argument(
        "--dry-run", action="store_true", help="print artifacts, commands and the workload plan; start nothing"
    )
    p.add_argument("--diagnostic", action="store_true", help="run on a busy machine, labelled as diagnostic")


def arm_names(text: str) -> list[str]:
    """--arms: names separated by commas; '' (none) leaves only the --arm servers."""
    return [v.strip() for v in text.split(",") if v.strip()]


def hex_nonce(text: str) -> str:
    """--nonce: hex digits, at most 64."""
    value = text.strip().lower()
    if not 0 < len(value) <= 64 or value.strip("0123456789abcdef"):
        raise argparse.ArgumentTypeError(f"{text!r}: give hex digits (at most 64), e.g. a run's settings.run_nonce")
    return value


def rates(text: str) -> tuple[float, ...]:
    """--rates: 'sweep' or 'sweep:START' (requests/s), or requests/s separated by commas (all at once is what the
    concurrency cells do)."""
    if text.strip().startswith("sweep"):
        _, _, start = text.strip().partition(":")
        try:
            first = float(start) if start else SWEEP_START
        except ValueError:
            first = -1.0
        if not 0 < first < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: sweep, or sweep:START with START requests/s above 0")
        return ("sweep",) + tuple(sweep_rates(first))
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or not all(0 < v < float("inf") for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give finite requests/s above 0, separated by commas (e.g. "
            "1,2,4), or sweep; all at once is --concurrency N"
        )
    return values


def slo(text: str) -> tuple[str, float]:
    """A --goodput item, METRIC:MS, as (metric, ms)."""
    metric, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if metric not in SLO_METRICS or not value > 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and MS > 0, e.g. ttft:2000"
        )
    return metric, value


def _run_plan(args):
    try:
        arms = resolve_arms(
            args.arms, options=parse_arm_options(args.arm_args), external=[external_arm(item) for item in args.arm]
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    if not arms:
        raise CliError("no arms: name them with --arms, or give a server the harness did not start with --arm NAME=URL")
    if len({a.name for a in arms}) != len(arms):
        raise CliError("an arm is listed twice")
    cpu_default = not args.models and not args.model_path
    tokens = args.tokens or (DEFAULT_CPU_TOKENS if cpu_default else 192)
    skip_context = args.skip_context or (cpu_default and args.context is None)
    context = None if skip_context else (args.context or 4096)
    if len({k for k, _ in args.goodput}) != len(args.goodput):
        raise CliError("--goodput names a metric twice")
    settings = RunSettings(
        tokens=tokens,
        decode_samples=args.decode_samples,
        request_timeout_s=args.request_timeout,
        stall_timeout_s=args.stall_timeout,
        goodput=tuple(args.goodput),
        quality_tokens=args.quality_tokens,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        sweep=args.rates[:1] == ("sweep",),
        slo_target=args.slo_target,
        **cells.option_values(args, cells.RUN),
        cell_repeats=getattr(args, "cell_repeats", 1),
        workload=WorkloadSettings(
            seed=args.workload_seed,
            concurrency=tuple(args.concurrency),
            context_tokens=context,
            rate_requests=args.rate_requests,
            rates=tuple(r for r in args.rates if r != "sweep"),
            prefix_groups=args.prefix_groups,
            prefix_group_size=args.prefix_group_size,
            prefix_tokens=args.prefix_tokens,
            chats=args.chats,
            turns=args.turns,
            chat_requests=args.chat_requests,
            **cells.option_values(args, cells.WORKLOAD),
        ),
    )
    if args.nonce:
        settings = replace(settings, run_nonce=args.nonce)
    if args.model_path:
        targets = [(args.label or args.model_path.name, resolve_model_dir(model_path=args.model_path))]
    else:
        names = args.models or DEFAULT_CPU_MODELS
        targets = [(n, None if args.dry_run else resolve_model_dir(model=n, seed=args.seed)) for n in names]
    return arms, settings, targets


def cmd_run(args) -> int:
    return _run(args, seeds=[args.workload_seed], kind="run")


def cmd_trials(args) -> int:
    return _run(args, seeds=[args.workload_seed + i for i in range(args.seeds)], kind="trials")


def _run(args, seeds: list[int], kind: str) -> int:
    """Exit status: 0 when every arm was measured, 1 when one was not, 128 + the signal's number when a
    signal (SIGTERM, SIGHUP, SIGINT) interrupted the run (recorded as interrupted in the JSON and the DB)."""
    arms, settings, targets = _run_plan(args)
    if kind == "trials" and len(arms) < 2:
        raise CliError("trials compare arms: give at least two (--arms A,B, or --arm NAME=URL)")
    blocks = blocks_of(kind, seeds, arms, settings.cell_repeats)
    out = args.out or Path("reports") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if args.dry_run:
        return _dry_run(args, blocks, settings, targets, out)
    check = preflight.check()
    if not check.ok and not args.diagnostic:
        raise CliError(
            "the machine is busy: " + "; ".join(check.problems) + " (wait, or pass --diagnostic to "
            "run anyway with the run labelled diagnostic)"
        )
    total = progress_steps(settings, blocks, len(targets))
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task("starting", total=total)
    seen = []

    def on_phase(desc: str) -> None:
        if seen:
            progress.advance(task)
        seen.append(desc)
        progress.update(task, description=escape(desc))

    interrupts = Interrupts()
    runner = Runner(
        settings,
        out,
        args.db,
        kind=kind,
        label=args.label,
        diagnostic=args.diagnostic,
        preflight=check.as_record(),
        log=lambda m: progress.console.print(m, markup=False, highlight=False),
        on_phase=on_phase,
        interrupts=interrupts,
        recheck=lambda: preflight.check(RECHECK_S).as_record(),
    )
    signum = None
    with interrupts.installed(), progress:
        try:
            runner.run(targets, blocks)
        except KeyboardInterrupt:
            signum = interrupts.fired or signal.SIGINT
    rs = _print_summary(runner.record, out, args.db)
    if "vllm" in args.export:
        path = out.with_suffix(".vllm.json")
        path.write_text(json.dumps(export(runner.record.to_json()), indent=1) + "\n")
        console.print(f"vLLM bench serve results: {path}", markup=False, highlight=False)
    if signum is not None:
        console.print(f"{runner.record.error}: recorded as interrupted in {out} and {args.db}", markup=False)
        return 128 + signum
    return 1 if any(r["status"] != "measured" for r in rs) else 0


SUMMARY_COLUMNS = 100  # the summary's tables and wrapped lines fit this many columns


def _print_summary(record, out: Path, db: Path) -> list[dict]:
    """The summary (`summary.model_summaries`) on stdout, its Markdown next to the JSON; every table and line
    fits SUMMARY_COLUMNS (a run nonce or a path may not), and every label is printed as text, never as markup."""
    run = record.to_json()
    out_md = out.with_suffix(".md")
    out_md.write_text(summary.markdown(run))
    stdout.print(
        f"{record.kind} {record.run_id}" + (" [DIAGNOSTIC: measured on a busy machine]" if record.diagnostic else ""),
        markup=False,
        highlight=False,
    )
    for ms in summary.model_summaries(run):
        stdout.print(_table(ms.model, ms.headers, ms.rows))
        for line in [ms.against] * bool(ms.against) + ms.lines + ms.notes:
            _say(line, "  ", "      ")
        stdout.print()
    latency = summary.latency_rows(run)
    if latency:
        # the Markdown's columns less the model's (one a row) and ITL's (TPOT's, but for stalls, flagged below)
        slos = bool(run["settings"].get("goodput"))
        keep = [
            i
            for i, h in enumerate(summary.LATENCY_HEADERS)
            if h != "model" and not h.startswith("ITL") and (slos or i < 8)
        ]
        rows = [[row[i].replace(" / ", "/") for i in keep] for row in latency]
        names = {"requests": "n", "SLO attainment": "SLO met"}
        heads = [names.get(h, h.replace(" / ", "/")) for h in (summary.LATENCY_HEADERS[i] for i in keep)]
        stdout.print(_table("latency percentiles per timed cell", heads, rows))
        stdout.print()
    for line in summary.load_lines(run) + summary.goodput_lines(run) + summary.quality_lines(run):
        _say(line, "", "    ")
    for line in flagged_lines(run):
        _say(f"FLAGGED {line}", "", "    ")
    stdout.print(f"JSON: {out}   Markdown: {out_md}   DB: {db} (run {record.run_id})", markup=False, highlight=False)
    return summary.rows(run)


def _table(title: str, headers: list[str], rows: list[list[str]]):
    table = Table(
        title=escape(title),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 0, 0, 1),
    )
    for h in headers:
        table.add_column(escape(_two_lines(h)), overflow="fold")
    for row in rows:
        table.add_row(*(escape(c) for c in row))  # a label is text, not markup
    return table


def _two_lines(header: str) -> str:
    """A header over two lines, split where its longer line is shortest ('TTFT' over 'cold ms'): a column's values
    are mostly narrower than its name."""
    words = header.split(" ")
    if len(header) <= 8 or len(words) < 2:
        return header
    cut = min(range(1, len(words)), key=lambda i: max(len(" ".join(words[:i])), len(" ".join(words[i:]))))
    return " ".join(words[:cut]) + "\n" + " ".join(words[cut:])


def _say(text: str, indent: str, hanging: str) -> None:
    for line in textwrap.wrap(
        text, SUMMARY_COLUMNS, initial_indent=indent, subsequent_indent=hanging, break_on_hyphens=False
    ) or [""]:
        stdout.print(line, markup=False, highlight=False, soft_wrap=True)


def _dry_run(args, blocks, settings, targets, out: Path) -> int:
    print_ = stdout.print
    print_(f"would write {out} and {args.db}; nothing is started")
    for name, model_dir in targets:
        if model_dir is None:
            spec = get_spec(name)
            cached = is_cached(spec.name, args.seed)
            print_(
                f"model {name}: registry artifact {spec.name}, seed {args.seed} "
                f"({'cached' if cached else 'would be synthesized'})"
            )
            model_dir = artifact_dir(spec.name, args.seed) if cached else None
        else:
            print_(f"model {name}: {model_dir}")
        for i, block in enumerate(blocks):
            print_(
                f"  block {i}: workload seed {block.seed}; arms in order {[a.name for a in block.arms]}"
                + ("; a repetition of the warm-up and the load cells" if block.is_repetition else "")
            )
            if any(a.url for a in block.arms):
                nonce = settings.run_nonce or "(drawn when the run starts)"
                print_(f"    --arm servers: every prompt but the probe's opened by run nonce {nonce}")
            for arm in block.arms:
                print_(
                    f"    {arm.name}: {' '.join(arm.command(model_dir or Path(f'<{name}>'), 0))}  (port: free, at start)"
                )
            if model_dir is None:
                continue
            wl, path = load_or_build(name, model_dir, replace(settings.workload, seed=block.seed))
            print_(f"    workload sha256 {wl.sha256[:16]} ({path or 'built now, not committed'})")
            for phase in block.phases(settings.workload):
                prompts = wl.prompts(phase, 0)
                sizes = [f"{len(p['messages'])} messages" if isinstance(p, dict) else len(p) for p in prompts][:8]
                print_(
                    f"      {phase:16s} {len(prompts) * settings.repeats(phase)} request(s), prompt "
                    f"{'sizes' if isinstance(prompts[0], dict) else 'tokens'} {sizes}, output "
                    f"{settings.output_tokens(phase)} tokens"
                )
    return 0


def add_workloads(sub) -> None:
    wl = sub.add_parser(
        "workloads",
        help="write the standard frozen workloads to goldens/workloads/",
        description="Build each model's standard workload (seed 0 unless --workload-seed; every phase `harness run all` "
        "can ask for, long context 4096 included) from its artifact's tokenizer and write it under "
        "goldens/workloads/, where runs pick it up when their settings are covered.",
    )
    model_source(wl)
    wl.add_argument("--workload-seed", type=int, default=0, help="workload seed (default 0)")
    wl.set_defaults(func=cmd_workloads, seed=0)


def cmd_workloads(args) -> int:
    for name, path in targets(args):
        settings = replace(STANDARD, seed=args.workload_seed)
        encode, sha = tokenizer_for(path)
        workload = build(name, encode, sha, settings)
        dest = golden_path(name, settings)
        save(workload, dest)
        stdout.print(f"{name}: {dest} sha256 {workload.sha256[:16]}")
    return 0
