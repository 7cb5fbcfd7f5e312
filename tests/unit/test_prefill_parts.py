"""tools.gpu.prefill_parts on a tiny hybrid model: every part of a prefill forward timed and its nodes counted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_each_part_reports_its_time_and_nodes(tiny_path):
    cmd = [
        sys.executable,
        "-m",
        "tools.gpu.prefill_parts",
        "--model-path",
        str(tiny_path("tiny-qwen35")),
        "--shapes",
        "1x24,2x16",
        "--reps",
        "1",
        "--force",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefill parts on the fast tier" in proc.stdout
    for shape in ("1x24", "2x16"):
        assert re.search(
            rf"^prefill {shape}: whole forward [0-9.]+ ms, with every part synced [0-9.]+ ms", proc.stdout, re.M
        )
    for part in ("layer", "mlp", "norm", "deltanet", "deltanet.rule", "deltanet.conv_heads", "attention.attend"):
        # a part's calls, ms a pass, ms a call and nodes (the chunked rule: a few dozen nodes, not one chain a token)
        assert re.search(rf"^  {re.escape(part)} +\d+ +[0-9.]+ +[0-9.]+ +\d+ ", proc.stdout, re.M), (part, proc.stdout)
    assert re.search(r"^  deltanet\.rest +\d+ +-?[0-9.]+ +-?[0-9.]+ *$", proc.stdout, re.M), proc.stdout


def test_the_instrumented_classes_are_restored(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import mlx.core as mx

    from engine.engine import Engine
    from tools.gpu.prefill_parts import Tally, instrument

    model = Engine.load("tiny-qwen35", with_tokenizer=False).model
    before = {id(m): type(m) for _, m in model.named_modules()}
    tally = Tally()
    undo = instrument(model, tally, lambda: False)
    assert any(type(m).__name__.startswith("Timed") for _, m in model.named_modules())
    model(mx.array([[1, 2, 3, 4]]), model.make_cache())
    undo()
    assert {id(m): type(m) for _, m in model.named_modules()} == before
    assert tally.calls["layer"] == len(model.layers) and tally.seconds["mlp"] > 0


def test_ablation_times_the_forward_without_each_part(tiny_path):
    cmd = [sys.executable, "-m", "tools.gpu.prefill_parts", "--model-path", str(tiny_path("tiny-qwen35"))]
    cmd += ["--shapes", "1x24", "--reps", "1", "--force", "--ablate", "deltanet.rule,mlp"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^prefill 1x24: whole forward [0-9.]+ ms$", proc.stdout, re.M), proc.stdout
    for part in ("deltanet.rule", "mlp"):
        assert re.search(rf"^  {re.escape(part)} +[0-9.]+ +-?[0-9.]+ +-?\d+%$", proc.stdout, re.M), proc.stdout
    bad = subprocess.run([*cmd[:3], "--ablate", "norm"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ablate takes deltanet" in bad.stderr


def test_an_ablated_part_answers_with_zeros_after_its_first_call(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import mlx.core as mx

    from engine.engine import Engine
    from tools.gpu.prefill_parts import ablate

    model = Engine.load("tiny-qwen35", with_tokenizer=False).model
    mlp = model.layers[0].mlp
    x = mx.random.normal((1, 3, model.layers[0].input_layernorm.weight.shape[0])).astype(mx.bfloat16)
    want = mlp(x)
    undo = ablate(model, "mlp")
    assert mx.array_equal(mlp(x), want).item()  # the first call at this shape runs the part
    again = mlp(x)
    assert again.shape == want.shape and again.dtype == want.dtype and not mx.any(again).item()
    undo()
    assert mx.array_equal(mlp(x), want).item()
