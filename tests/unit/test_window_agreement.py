"""tools.gpu.window_agreement on a tiny hybrid model: off CUDA a verify window's tokens are the steps' exactly."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_windows_agree_with_steps_off_cuda(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from tools.gpu.window_agreement import measure

    measure("tiny-qwen35", tokens=10, window=4, prompt_tokens=24, tier="fast")
    out = capsys.readouterr().out
    assert "margin p10" in out
    assert len(re.findall(r"argmax differs from the step's at 0/8; largest logit difference median 0\.0000", out)) == 2
