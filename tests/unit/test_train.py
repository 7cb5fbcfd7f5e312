"""oracles.train: a few steps of the trained family on a slice of the standard library, end to end."""

from __future__ import annotations

import json

import pytest

from engine import env
from engine.errors import ModelLoadError
from engine.synth import artifact_dir, ensure_model
from oracles import train
from oracles.train_data import is_held_out, load_corpus

TINY_RUN = [
    "--steps",
    "2",
    "--batch",
    "2",
    "--seq",
    "32",
    "--warmup",
    "1",
    "--eval-tokens",
    "128",
    "--max-bytes",
    "300000",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    assert train.main(["--models", "trained-qwen3-draft,trained-qwen35", "--out", str(out), *TINY_RUN]) == 0
    return out


def test_the_corpus_splits_files_by_name_and_records_what_it_read():
    corpus = load_corpus(300_000)
    names = [f.name for f in corpus.train + corpus.held_out]
    assert len(names) == len(set(names))
    assert all(is_held_out(f.name) for f in corpus.held_out) and not any(is_held_out(f.name) for f in corpus.train)
    assert "engine/synth/corpus.txt" in names
    assert corpus.sha256 == load_corpus(300_000).sha256
    assert corpus.summary()["python"] == corpus.python


@pytest.mark.parametrize(
    "name", ["trained-qwen3-draft", "trained-qwen3-draft-4bit", "trained-qwen35", "trained-qwen35-4bit"]
)
def test_each_model_is_written_with_its_manifest_and_serves(trained, name):
    from engine.engine import Engine
    from engine.generate import generate
    from engine.request import StopCriteria

    manifest = json.loads((trained / name / "manifest.json").read_text())
    assert manifest["name"] == name and manifest["settings"]["steps"] == 2
    assert manifest["data"]["sha256"] and manifest["data"]["python"]
    assert set(manifest["result"]) >= {"train_loss", "held_out_loss", "held_out_loss_at_init"}
    assert set(manifest["files"]) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    engine = Engine.load(None, trained / name)
    assert ("quantization" in engine.config) == name.endswith("-4bit")
    assert getattr(engine.model, "has_mtp", False) == name.startswith("trained-qwen35")
    ids = [t.token_id for t in generate(engine.model, [5, 6, 7], stop=StopCriteria(max_tokens=4, ignore_eos=True))]
    assert len(ids) == 4 and all(0 <= i < 4096 for i in ids)


def test_the_family_shares_one_tokenizer(trained):
    texts = {(trained / n / "tokenizer.json").read_text() for n in ("trained-qwen3-draft", "trained-qwen35-4bit")}
    assert len(texts) == 1


def test_training_is_deterministic(trained, tmp_path):
    assert train.main(["--models", "trained-qwen3-draft", "--out", str(tmp_path), *TINY_RUN]) == 0
    again = json.loads((tmp_path / "trained-qwen3-draft" / "manifest.json").read_text())["files"]
    first = json.loads((trained / "trained-qwen3-draft" / "manifest.json").read_text())["files"]
    assert again["model.safetensors"] == first["model.safetensors"]


def test_a_prepared_file_trains_the_same_weights_as_the_text_it_came_from(trained, tmp_path):
    data = tmp_path / "data.npz"
    assert train.main(["--prepare", str(data), *TINY_RUN]) == 0
    assert not (tmp_path / "trained-qwen3-draft").exists()
    args = [a for a in TINY_RUN if a not in ("--max-bytes", "300000")]
    assert train.main(["--models", "trained-qwen3-draft", "--data", str(data), "--out", str(tmp_path), *args]) == 0
    again = json.loads((tmp_path / "trained-qwen3-draft" / "manifest.json").read_text())
    first = json.loads((trained / "trained-qwen3-draft" / "manifest.json").read_text())
    assert again["files"]["model.safetensors"] == first["files"]["model.safetensors"]
    assert again["files"]["tokenizer.json"] == first["files"]["tokenizer.json"]
    assert again["data"] == first["data"]


def test_a_trained_name_is_never_synthesized(monkeypatch, tmp_path):
    monkeypatch.setattr(env, "trained_dir", lambda: tmp_path)
    assert artifact_dir("trained-qwen3") == tmp_path / "trained-qwen3"
    with pytest.raises(ModelLoadError, match="python -m oracles.train"):
        ensure_model("trained-qwen3-4bit")


def test_unknown_models_are_refused():
    with pytest.raises(SystemExit):
        train.main(["--models", "tiny-qwen3"])


def test_synthesizing_a_trained_name_is_refused_before_anything_is_written(tmp_path, capsys):
    from harness.cli import main

    assert main(["models", "synth", "tiny-qwen3", "trained-qwen3", "--seed", "7"]) != 0
    assert "trained models are made by `python -m oracles.train`" in capsys.readouterr().err
    assert not artifact_dir("tiny-qwen3", 7).exists()


def test_a_step_that_is_not_finite_is_skipped_and_many_in_a_row_stop_training(monkeypatch):
    import mlx.core as mx
    import numpy as np

    from engine.registry import get_spec

    model, _ = train.build_model(get_spec("trained-qwen3-draft"), [0], seed=0)
    ids = np.arange(2000, dtype=np.int32) % 4000
    real = train.losses
    calls = []

    def poisoned(model, x, y, weight):  # the second step's loss is NaN
        calls.append(1)
        total, lm = real(model, x, y, weight)
        return (total * mx.nan, lm * mx.nan) if len(calls) == 2 else (total, lm)

    monkeypatch.setattr(train, "losses", poisoned)
    lines = []
    settings = train.TrainSettings(steps=3, batch=2, seq=16, warmup=1)
    history, skipped = train.train(model, ids, settings, lines.append)
    assert skipped == [2] and len(history) == 2 and all(np.isfinite(history))
    assert any("step 2:" in line and "skipped" in line for line in lines)

    monkeypatch.setattr(train, "losses", lambda m, x, y, w: tuple(t * mx.nan for t in real(m, x, y, w)))
    monkeypatch.setattr(train, "MAX_SKIPPED_IN_A_ROW", 3)
    with pytest.raises(RuntimeError, match="3 steps in a row"):
        train.train(model, ids, train.TrainSettings(steps=10, batch=2, seq=16, warmup=1), lines.append)
