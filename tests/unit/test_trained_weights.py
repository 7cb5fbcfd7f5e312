"""The committed weights of the registry's `trained` tier: intact, loadable, and far better than chance on the
held-out text (a randomly initialized model of the family scores a perplexity near its 4096-entry vocabulary)."""

import json

import pytest

from engine import env
from engine.synth.artifact import MANIFEST, file_record
from harness.gates.quality import held_out_score

COMMITTED = sorted(p for p in env.trained_dir().iterdir() if (p / MANIFEST).exists())


def test_the_whole_family_is_committed():
    names = {p.name for p in COMMITTED}
    family = ("trained-qwen35", "trained-qwen3", "trained-qwen3-draft")
    assert {n + v for n in family for v in ("", "-4bit")} <= names


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_each_file_matches_its_manifest(path):
    manifest = json.loads((path / MANIFEST).read_text())
    assert {name: file_record(path / name) for name in manifest["files"]} == manifest["files"]


@pytest.mark.parametrize("path", [p for p in COMMITTED if not p.name.endswith("-4bit")], ids=lambda p: p.name)
def test_each_model_predicts_held_out_python(path):
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["result"]["held_out_perplexity"] < 30
    score = held_out_score(path, "exact", 256)
    assert score["perplexity"] < 40, score
