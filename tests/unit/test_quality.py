"""harness quality: perplexity and KL against the reference, per variant, on a tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.cli import main
from harness.gates.quality import QualitySettings, measure, score

SMALL = QualitySettings(tokens=192, window=96, chunk=32)


@pytest.fixture(scope="module")
def result(tiny_path):
    return measure("tiny-qwen35", tiny_path("tiny-qwen35"), SMALL, weight_bits=(8, 4), kv_bits=(8, 4))


def test_every_variant_is_scored_against_the_reference(result):
    assert [r.variant for r in result.rows] == ["bf16", "bf16 kv8", "bf16 kv4", "8bit", "4bit"]
    assert result.tokens == 192
    ref, *others = result.rows
    assert ref.mean_kl is None and ref.perplexity == pytest.approx(np.exp(ref.nll), rel=1e-3)
    assert all(r.mean_kl is not None and r.mean_kl >= 0 and 0 <= r.top1_agreement <= 1 for r in others)


def test_fewer_bits_move_further_from_the_reference(result):
    kl = {r.variant: r.mean_kl for r in result.rows}
    assert kl["bf16 kv8"] < kl["bf16 kv4"]
    assert kl["8bit"] < kl["4bit"]


def test_the_score_of_identical_distributions_is_zero_kl():
    lp = np.log(np.full((3, 4), 0.25, dtype=np.float32))
    row = score("x", "bf16", None, "exact", lp, np.array([0, 1, 2]), lp)
    assert row.mean_kl == 0 and row.top1_agreement == 1 and row.perplexity == pytest.approx(4, rel=1e-4)


def test_the_command_writes_json_and_markdown(tiny_path, tmp_path, capsys):
    out, md = tmp_path / "q.json", tmp_path / "q.md"
    args = [
        "quality",
        "--model-path",
        str(tiny_path("tiny-qwen3")),
        "--tokens",
        "64",
        "--window",
        "64",
        "--chunk",
        "32",
        "--weight-bits",
        "",
        "--kv-bits",
        "8",
        "--kv-group-size",
        "32",
        "--json",
        str(out),
        "--md",
        str(md),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())[0]["rows"]
    assert [r["variant"] for r in rows] == ["bf16", "bf16 kv8"]
    assert "| bf16 kv8 |" in md.read_text() and "perplexity" in capsys.readouterr().out


def test_bad_settings_are_refused(tiny_path, capsys):
    assert main(["quality", "--model-path", str(tiny_path("tiny-qwen3")), "--kv-bits", "3"]) != 0
    assert "--kv-bits takes 4 and 8" in capsys.readouterr().err
    args = ["quality", "--model-path", str(tiny_path("tiny-qwen3")), "--tokens", "32", "--kv-bits", "8"]
    assert main(args) != 0  # head size 32 and KV groups of 64
    assert "divisible by the quantization group size" in capsys.readouterr().err
