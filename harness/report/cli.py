"""`harness report` (saved JSON -> HTML, Markdown or JSON) and `harness db` (list runs, export one)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from harness.cli_common import CliError, console, db_option
from harness.cli_common import out as stdout
from harness.report.db_export import export_run, requests_frame
from harness.run.records import open_db


def add_report(sub) -> None:
    p = sub.add_parser(
        "report",
        help="render saved JSON as one self-contained HTML file (or Markdown / JSON)",
        description="Read `harness run all` / `harness trials` records and `harness native` / `spec` / `quality` "
        "JSON (nothing else: no model, server or network) and render a comparison: the headline (each arm "
        "against the baseline with a 95 percent interval and verdict, or the reason the ratio is withheld), the "
        "throughput-latency curves and latency distributions, the serving matrix with a status on every cell, "
        "paired verdicts for trials, the in-process results, token identity, provenance and stability, "
        "failures, raw requests (docs/report.md).",
    )
    p.add_argument("inputs", nargs="+", type=Path, help="run, trials, native, spec or quality JSON files")
    p.add_argument("--out", type=Path, help="write here (default: stdout for md/json, compare.html for html)")
    p.add_argument("--baseline", help="arm the ratios divide by (default: mlx-lm when present)")
    p.add_argument("--format", choices=["html", "md", "json"], default="html")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    # on use: the report's plots load matplotlib (~0.4 s), which `harness db` and `harness --help` do not need
    from harness.report import page as report

    try:
        view = report.build_view(report.load(args.inputs), args.baseline)
    except ValueError as e:
        raise CliError(str(e)) from None
    text = {"html": report.render_html, "md": report.render_markdown, "json": report.render_json}[args.format](view)
    out = args.out or (Path("compare.html") if args.format == "html" else None)
    if out is None:
        print(text, end="")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        console.print(f"wrote {out} ({len(text):,} bytes)")
    return 0


def add_db(sub) -> None:
    p = sub.add_parser("db", help="the run database: list runs, export one (JSON, or its requests as CSV)")
    dsub = p.add_subparsers(dest="db_command", required=True, metavar="SUBCOMMAND")
    ls = dsub.add_parser("list", help="runs in the database, newest first")
    db_option(ls)
    ls.set_defaults(func=cmd_db_list)
    ex = dsub.add_parser(
        "export",
        help="one run as JSON that `harness report` reads, or its requests as CSV",
        description="json: the run record rebuilt from the database. csv: one row per request (run_id, block, "
        "model, arm, phase, attempt, idx, then the request's status and metric columns).",
    )
    ex.add_argument("run_id")
    db_option(ex)
    ex.add_argument("--format", choices=["json", "csv"], default="json")
    ex.add_argument("--out", type=Path, help="write here (default: stdout)")
    ex.set_defaults(func=cmd_db_export)


def _open(path: Path):
    if not path.exists():
        raise CliError(f"no database at {path} (harness run writes one; --db PATH to point elsewhere)")
    return open_db(path)


def cmd_db_list(args: argparse.Namespace) -> int:
    db = _open(args.db)
    table = Table(title=escape(str(args.db)))
    for col in ("run", "created", "kind", "label", "host", "commit", "models / arms", "status", "JSON"):
        table.add_column(col)
    for r in db.query("select * from runs order by created desc"):
        arms = list(db.query("select distinct model, arm from arms where run_id = ?", [r["run_id"]]))
        models = sorted({a["model"] for a in arms})
        cells = [
            r["run_id"],
            r["created"],
            r["kind"] + (" (diagnostic)" if r["diagnostic"] else ""),
            r["label"] or "-",
            r["host"] or "-",
            (r["git_commit"] or "")[:10],
            f"{', '.join(models)} / {len({a['arm'] for a in arms})}",
            r.get("status") or ("finished" if r["finished"] else "unfinished"),
            r["json_path"] or "-",
        ]
        table.add_row(*(escape(str(c)) for c in cells))  # labels and names are text, not rich markup
    stdout.print(table)
    return 0


def cmd_db_export(args: argparse.Namespace) -> int:
    db = _open(args.db)
    try:
        if args.format == "csv":
            text = requests_frame(db, args.run_id).to_csv(index=False)
        else:
            text = json.dumps(export_run(db, args.run_id), indent=1) + "\n"
    except KeyError:
        raise CliError(f"no run {args.run_id!r} in {args.db} (see `harness db list`)") from None
    if args.out:
        args.out.write_text(text)
        console.print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
