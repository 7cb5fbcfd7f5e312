"""tools.gpu.window_cost on a tiny hybrid model: a step and windows timed, with the DeltaNet path each took."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_steps_and_windows_report_their_cost_and_paths():
    cmd = [sys.executable, "-m", "tools.gpu.window_cost", "--model", "tiny-qwen35", "--rows", "1,2"]
    cmd += ["--widths", "3", "--reps", "1", "--prompt-tokens", "12", "--force"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on the fast tier, 3 DeltaNet layers" in proc.stdout
    for rows in (1, 2):
        step = rf"^rows +{rows} step +[0-9.]+ ms \(1\.00 steps\); DeltaNet paths: decode step 3$"
        window = rf"^rows +{rows} window 3 +[0-9.]+ ms \([0-9.]+ steps\), rollback [0-9.]+ ms; DeltaNet paths: verify window 3$"
        assert re.search(step, proc.stdout, re.M) and re.search(window, proc.stdout, re.M), proc.stdout
    bad = subprocess.run([*cmd[:3], "--widths", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "at least one draft" in bad.stderr
