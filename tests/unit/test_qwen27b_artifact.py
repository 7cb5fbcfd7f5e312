"""The true-geometry 27B artifact: ~15 GB and about a minute to synthesize, so `slow`."""

import json
import struct

import pytest

from engine.registry import get_spec
from engine.synth.plan import tensor_plan
from engine.synth.weights import planned_weight_bytes

pytestmark = pytest.mark.slow


def _headers(path):
    out = {}
    for shard in sorted(path.glob("model*.safetensors")):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update(header)
    return out


def test_qwen27b_config_shapes_bytes_and_lazy_load(tiny_path):
    import mlx_lm

    from engine.loading import load_model

    spec = get_spec("qwen27b")
    path = tiny_path("qwen27b")
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (64, 5120, 248_320)
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    headers = _headers(path)
    for t in tensor_plan(spec):
        if t.is_matrix:
            rows, cols = t.shape
            assert headers[f"{t.name}.weight"]["shape"] == [rows, cols // 8]
            assert headers[f"{t.name}.scales"]["shape"] == [rows, cols // 64]
        else:
            assert headers[t.name]["shape"] == list(t.shape)
    data_bytes = sum(h["data_offsets"][1] - h["data_offsets"][0] for h in headers.values())
    assert data_bytes == planned_weight_bytes(spec)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == data_bytes
    model, _ = mlx_lm.load(str(path), lazy=True)
    assert model.layers[3].self_attn.q_proj.weight.shape == (24 * 256 * 2, 5120 // 8)
    ours, _ = load_model(path, lazy=True)
    assert ours.has_mtp and len(ours.layers) == 64
