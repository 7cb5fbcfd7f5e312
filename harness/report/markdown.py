"""`harness report --format md`: the report's view (`report.build_view`) as Markdown, every string escaped
(`summary.md_cell` / `md_text`)."""

from __future__ import annotations

from harness.run.headline import Part, VerdictLine, interval_text, line_text, value_text
from harness.run.summary import md_row, md_text


def ratio_text(r: dict) -> str:
    """A compared row's ratio as text: the ratio with its interval and verdict, or why it is withheld."""
    if r["withheld"]:
        return f"withheld: {r['withheld']}"
    if r["ratio"] is None:
        return "-"
    interval = interval_text(r["ci_low"], r["ci_high"])
    verdict = f" {r['verdict']}" if r["verdict"] else ""
    return f"{r['ratio']:.2f}{' ' + interval if interval else ''}{verdict}" + (f" ({r['note']})" if r["note"] else "")


def render_markdown(view: dict) -> str:
    lines = [
        f"# {md_text(view['title'])}",
        "",
        f"## Verdicts: each arm against {md_text(view['baseline'])}",
        "",
        f"Nx: how many times as fast as {md_text(view['baseline'])} (a rate: arm / baseline; a time: baseline / "
        f"arm), its 95% interval in brackets; a verdict against a {view['single_run_threshold']:.0%} noise "
        "threshold; an aggregate rate of one burst has no interval.",
        "",
    ]
    for group in view["verdicts"]:
        lines += [f"**{md_text(group['title'])}** ({md_text(group['source'])})", ""]
        lines += [
            f"- {md_text(line_text(VerdictLine(line['arm'], [Part(**p) for p in line['parts']], line['rest'])))}"
            for line in group["lines"]
        ]
        lines += [f"- {md_text(group['withheld'])}"] * bool(group["withheld"]) + [""]
    lines += [
        "## Headline: every ratio",
        "",
        "Ratio = arm / baseline; a median's interval resamples the paired "
        "requests (one run), a repeated load cell's comes from its repetitions.",
        "",
    ]
    for group in view["headline"]:
        lines += [f"### {md_text(group['title'])} ({md_text(group['source'])})", ""]
        lines += [md_text(group["note"]), ""] if group["note"] else []
        lines += ["| arm | metric | value | baseline | ratio |", "|---|---|---|---|---|"]
        for r in group["rows"]:
            lines.append(
                md_row(
                    [
                        r["arm"],
                        r["metric"],
                        value_text(r["value"], r["unit"]),
                        value_text(r["baseline"], r["unit"]),
                        ratio_text(r),
                    ]
                )
            )
        lines.append("")
    if view["flagged"]:
        lines += ["## Flagged cells", ""] + [f"- {md_text(f)}" for f in view["flagged"]] + [""]
    lines += ["## Serving matrix", ""]
    for mach, m in view["machines"].items():
        lines += [
            f"### {md_text(mach)}",
            "",
            md_row(["run / model", "arm", *m["phases"]]),
            "|---|---|" + "---|" * len(m["phases"]),
        ]
        for r in m["rows"]:
            cells = [f"{c['status']}" + (f": {c['value']}" if c["value"] else "") for c in r["cells"]]
            lines.append(md_row([r["where"], r["arm"], *cells]))
        lines.append("")
    lines += ["## Latency percentiles", ""]
    for group in view["latency"]:
        lines += (
            [
                f"### {md_text(group['run'])}",
                "",
                md_row(view["latency_headers"]),
                "|" + "---|" * len(view["latency_headers"]),
            ]
            + [md_row(r) for r in group["rows"]]
            + [""]
        )
    if view["paired"]:
        lines += [
            "",
            "## Paired blocks",
            "",
            "| model | arm | metric | blocks | geomean | 95% interval | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in view["paired"]:
            if p["withheld"]:
                lines.append(
                    md_row(
                        [
                            p["model"],
                            p["arm"],
                            f"{p['label']} ({p['phase']})",
                            "-",
                            "-",
                            "-",
                            f"withheld: {p['withheld']}",
                        ]
                    )
                )
                continue
            ci = f"{p['ci_low']:.3f}-{p['ci_high']:.3f}" if p["ci_low"] is not None else "-"
            lines.append(
                md_row(
                    [
                        p["model"],
                        p["arm"],
                        p["metric"],
                        p["blocks"],
                        f"{p['geomean']:.3f}",
                        ci,
                        f"{p['verdict']} {p['note']}",
                    ]
                )
            )
    for n in view["native"]:
        lines += [
            "",
            f"## In process: {md_text(n['model'])} ({md_text(n['file'])})",
            "",
            "| arm | prefill tok/s | decode tok/s | TTFT ms |",
            "|---|---|---|---|",
        ]
        for side in ("engine", "mlx_lm"):
            a = n[side]
            lines.append(md_row([side, _num(a.get("prefill_tps")), _num(a.get("decode_tps")), _num(a.get("ttft_ms"))]))
        for what in ("decode", "prefill"):
            if n[what]:
                p = n[what]
                lines.append(
                    f"\n{what} engine / mlx-lm: {p['geomean']:.2f} {interval_text(p['ci_low'], p['ci_high'])} "
                    f"{p['verdict']} {md_text(p['note'])}"
                )
    for sp in view["spec"]:
        lines += [
            "",
            f"## Speculative decoding: {md_text(sp['model'])} ({md_text(sp['file'])})",
            "",
            "| arm | decode tok/s | vs plain | acceptance | tokens / target forward |",
            "|---|---|---|---|---|",
        ]
        for a in sp["arms"]:
            lines.append(
                md_row(
                    [
                        a["arm"],
                        _num(a["decode_tps"]),
                        _num(a["ratio"]),
                        _num(a["acceptance"]),
                        _num(a["tokens_per_forward"]),
                    ]
                )
            )
    for q in view["quality_files"]:
        lines += [
            "",
            f"## Held-out quality: {md_text(q['model'])} ({md_text(q['file'])})",
            "",
            "| variant | perplexity | mean KL | top-1 |",
            "|---|---|---|---|",
        ]
        for r in q["rows"]:
            lines.append(
                md_row(
                    [
                        r["variant"],
                        _num(r["perplexity"]),
                        _num(r.get("mean_kl"), ".2e"),
                        _num(r.get("top1_agreement"), ".1%"),
                    ]
                )
            )
    if view["quality"]:
        lines += [
            "",
            "## Quality and size",
            "",
            "| run / model | arm | tier | held-out tokens | perplexity | peak RSS MiB |",
            "|---|---|---|---|---|---|",
        ]
        for q in view["quality"]:
            ppl = f"not measured: {q['error']}" if q["perplexity"] is None else f"{q['perplexity']:g}"
            ppl += f" ({q['note']})" if q.get("note") else ""
            rss = f"{q['peak_rss_mib']:.0f}" if q["peak_rss_mib"] else "-"
            lines.append(md_row([q["where"], q["arm"], q["tier"] or "-", q["tokens"] or "-", ppl, rss]))
    if view["failures"]:
        lines += ["", "## Failures", ""] + [
            f"- {md_text(f['where'])} / {md_text(f['arm'])} / {md_text(f['what'])}: {md_text(f['error'])}"
            for f in view["failures"]
        ]
    return "\n".join(lines) + "\n"


def _num(x, spec: str = ",.2f") -> str:
    return "-" if x is None else format(x, spec)
