"""`harness batch-bench`: the decode step at all rows, the kernel tier it runs, its table and JSON."""

import json
import math

from harness.bench.batch import full_batch_step_ms
from harness.cli import main as harness_main


def test_the_full_batch_step_is_taken_while_every_row_decodes():
    # rows start at 0, 1 and 2 s and stop at 9, 10 and 11: only the gaps within [2, 9] count
    rows = [[0, 1, 2, 3, 5, 9], [1, 2, 3, 4, 6, 10], [2, 4, 6, 8, 10, 11]]
    assert full_batch_step_ms(rows) == 2000.0  # gaps 1, 2, 4 | 1, 1, 2 | 2, 2, 2: median 2 s
    assert math.isnan(full_batch_step_ms([[0, 1], [5, 6]]))  # never all at once


def test_batch_bench_reports_the_tier_and_the_step_at_each_concurrency(tmp_path, capsys):
    out = tmp_path / "bb.json"
    assert (
        harness_main(
            [
                "batch-bench",
                "--models",
                "tiny-qwen3",
                "--concurrency",
                "2",
                "--samples",
                "1",
                "--warmup",
                "0",
                "--prompt-tokens",
                "8",
                "--decode-tokens",
                "6",
                "--kernels",
                "exact",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    records = json.loads(out.read_text())
    assert {r["label"] for r in records} == {"1 request, decode", "2 concurrent, aggregate", "2 rows, decode step"}
    assert all(r["kernels"] == "exact" for r in records)
    step = next(r for r in records if r["label"] == "2 rows, decode step")
    assert [b["name"] for b in step["baselines"]] == ["mlx-lm", "continuous, 1 row"] and step["ours"]["values"][0] > 0
    aggregate = next(r for r in records if r["label"] == "2 concurrent, aggregate")
    assert aggregate["tokens_identical"] is True  # the exact tier against mlx-lm
    assert "decode step" in capsys.readouterr().out
