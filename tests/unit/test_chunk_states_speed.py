"""tools.gpu.chunk_states_speed times a layer's chunked DeltaNet rule with its parts as MLX operations and as the
CUDA kernels (off CUDA: the MLX path only)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout


def test_every_length_and_batch_gets_a_line_and_a_row(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import chunk_states_speed

    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["chunk_states_speed", "--model", "tiny-qwen35", "--tokens", "20,70", "--rows", "1,2", "--calls", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "1"])
    chunk_states_speed.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "tokens: MLX loop" in line]
    rows = json.loads((tmp_path / "chunk-states-speed.json").read_text())["rows"]
    assert len(lines) == len(rows) == 4
    assert [(r["tokens"], r["rows"]) for r in rows] == [(20, 1), (20, 2), (70, 1), (70, 2)]
    assert all(r["mlx_us"] > 0 for r in rows)
