"""tools.gpu.attention_prefill_speed times a layer's prompt attention as MLX's operations and as the CUDA kernel
(off CUDA: MLX's only), with each one's distance from float32 attention."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout


def test_every_shape_gets_a_line_and_a_row(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu import attention_prefill_speed

    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["attention_prefill_speed", "--model", "tiny-qwen35", "--shapes", "64x64,40x200", "--calls", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "1"])
    attention_prefill_speed.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if " keys: MLX " in line]
    rows = json.loads((tmp_path / "attention-prefill-speed.json").read_text())["rows"]
    assert len(lines) == len(rows) == 2
    assert [(r["queries"], r["keys"]) for r in rows] == [(64, 64), (40, 200)]
    assert all(r["mlx_us"] > 0 and 0 < r["mlx_err"] < 0.05 for r in rows)  # bf16 attention, compared in float32
    assert attention_prefill_speed.causal_flops(2, 3, 1, 1) == 4.0 * (2 + 3)  # queries at 1 and 2 see 2 and 3 keys
