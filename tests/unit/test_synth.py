import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.registry import all_specs, get_spec
from engine.synth import artifact, synthesize
from engine.synth.plan import tensor_plan
from engine.synth.safetensors_writer import TensorEntry, write_safetensors
from engine.synth.weights import planned_weight_bytes, to_bf16_bits


def _hashes(path):
    return {k: v["sha256"] for k, v in json.loads((path / "manifest.json").read_text())["files"].items()}


def test_same_name_and_seed_gives_identical_bytes(tmp_path):
    a = synthesize(get_spec("tiny-qwen35-4bit"), 0, tmp_path / "a")
    b = synthesize(get_spec("tiny-qwen35-4bit"), 0, tmp_path / "b")
    assert _hashes(a) == _hashes(b)


def test_different_seed_changes_weights_not_tokenizer(tmp_path):
    a = _hashes(synthesize(get_spec("tiny-llama"), 0, tmp_path / "a"))
    b = _hashes(synthesize(get_spec("tiny-llama"), 1, tmp_path / "b"))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_manifest_hashes_match_the_files(tiny_path):
    import hashlib

    path = tiny_path("tiny-gemma3")
    for name, sha in _hashes(path).items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == sha, name


@pytest.mark.parametrize("spec", all_specs(("tiny",)), ids=lambda s: s.name)
def test_config_matches_registry_geometry(spec, tiny_path):
    config = json.loads((tiny_path(spec.name) / "config.json").read_text())
    text = config.get("text_config", config)
    g = spec.geometry
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert text[key] == getattr(g, key), key
    assert config["model_type"] == g.model_type
    if spec.quantization:
        block = {"group_size": spec.quantization.group_size, "bits": spec.quantization.bits, "mode": "affine"}
        assert config["quantization"] == block and config["quantization_config"] == block
    else:
        assert "quantization" not in config


@pytest.mark.parametrize("name", ["tiny-qwen35-4bit", "tiny-gemma3-f32", "tiny-qwen2-8bit"])
def test_tensor_shapes_follow_the_plan(name, tiny_path):
    spec = get_spec(name)
    arrays = mx.load(str(tiny_path(name) / "model.safetensors"))
    for t in tensor_plan(spec):
        key = f"{t.name}.weight" if t.is_matrix else t.name
        if spec.quantization and t.is_matrix:
            rows, cols = t.shape
            assert arrays[key].shape == (rows, cols * spec.quantization.bits // 32)
            assert arrays[f"{t.name}.scales"].shape == (rows, cols // spec.quantization.group_size)
        else:
            assert arrays[key].shape == t.shape


def test_planned_bytes_equal_written_bytes(tiny_path):
    for name in ("tiny-qwen35-4bit", "tiny-llama-f32"):
        arrays = mx.load(str(tiny_path(name) / "model.safetensors"))
        assert sum(a.nbytes for a in arrays.values()) == planned_weight_bytes(get_spec(name))


def test_large_artifacts_are_sharded_with_an_index(tmp_path):
    import mlx_lm

    path = synthesize(get_spec("tiny-llama"), 0, tmp_path / "m", shard_bytes=400_000)
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    model, _ = mlx_lm.load(str(path))  # mlx-lm reads every shard
    assert model is not None


def test_bf16_rounding_matches_mlx():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    ours = to_bf16_bits(x)
    theirs = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    assert np.array_equal(ours, theirs)


def test_safetensors_writer_round_trips(tmp_path):
    data = np.arange(24, dtype=np.float32).reshape(4, 6)

    def chunks():
        yield data[:3]
        yield data[3:]

    entry = TensorEntry("w", "F32", (4, 6), chunks)
    written = write_safetensors(tmp_path / "t.safetensors", [entry], {"format": "mlx"})
    assert written.nbytes == (tmp_path / "t.safetensors").stat().st_size
    assert np.array_equal(np.array(mx.load(str(tmp_path / "t.safetensors"))["w"]), data)


def test_writer_rejects_a_short_tensor(tmp_path):
    entry = TensorEntry("w", "F32", (4, 6), lambda: iter([np.zeros((2, 6), np.float32)]))
    with pytest.raises(AssertionError):
        write_safetensors(tmp_path / "t.safetensors", [entry], {})


def test_parameter_counts_are_in_their_tier_ranges():
    from engine.synth import parameter_count

    for spec in all_specs(("small",)):
        assert 20e6 <= parameter_count(spec) <= 100e6, spec.name
    assert math.isclose(parameter_count(get_spec("qwen27b")), 27.3e9, rel_tol=0.02)


def test_losing_the_race_to_synthesize_keeps_the_winners_artifact(tmp_path, monkeypatch):
    # xdist workers on a cold cache synthesize the same artifact at once (seen on the 16-core GPU
    # machine: "Directory not empty" from the loser's rename). Make another process finish between
    # this one's last look and its rename: the rename is refused and the winner's artifact stays.
    out = tmp_path / "m"
    real_replace = artifact.os.replace
    winner = synthesize(get_spec("tiny-llama"), 0, tmp_path / "winner")

    def replace_after_the_winner(src, dst):
        if not Path(dst).exists():
            real_replace(winner, dst)
        return real_replace(src, dst)

    monkeypatch.setattr(artifact.os, "replace", replace_after_the_winner)
    assert synthesize(get_spec("tiny-llama"), 0, out) == out
    assert (out / "manifest.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.tmp")]


def test_a_partial_artifact_left_by_a_crash_is_replaced(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # no manifest: a crash mid-write
    synthesize(get_spec("tiny-llama"), 0, out)
    assert (out / "manifest.json").exists()
