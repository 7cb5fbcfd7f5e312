"""tools.gpu.lone_lanes runs end to end on a tiny model: every arm, the warm-up, a burst and a reset."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_every_arm_and_phase_reports_a_rate(tiny_path, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "tools.gpu.lone_lanes",
        "--model-path",
        str(tiny_path("tiny-qwen35")),
        "--rounds",
        "1",
        "--tokens",
        "6",
        "--prompt-tokens",
        "9",
        "--warmup",
        "quick",
        "--burst",
        "3",
        "--reset",
        "--second-model",
        "--no-prebuild",
    ]
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for phase in (
        "fresh",
        "after a burst of 3",
        "MLX cache emptied",
        "reset",
        "a second model",
        "the first model again",
    ):
        for arm in ("generate", "runner", "serial", "continuous"):
            assert re.search(rf"^{phase} +{arm}: median [0-9.]+ tok/s", proc.stdout, re.M), (phase, arm, proc.stdout)
