"""tools.gpu.dequant_speed times MLX's dequantization against the engine's kernel on a model's matrices (off CUDA:
MLX's side only, the kernel's said not to run)."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout


def test_every_shape_gets_a_line_and_the_model_a_total(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import dequant_speed

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["dequant_speed", "--model", "tiny-qwen35-4bit", "--calls", "1", "--repeats", "1"])
    dequant_speed.main()
    out = capsys.readouterr().out
    assert "128x128" in out and "tiny-qwen35-4bit all layers: mlx" in out
    assert "needs MLX's CUDA backend" in out or "bit-equal True" in out
    rows = json.loads((tmp_path / "dequant-speed.json").read_text())["rows"]
    us, gbs = map(float, re.search(r"mlx ([0-9.]+) us \(([0-9]+) GB/s\)", out).groups())
    assert us == round(rows[0]["mlx_us"], 1) and gbs == round(rows[0]["mb_moved"] / rows[0]["mlx_us"] * 1e3)
