"""tools.gpu.burst_paths runs both arms end to end on a tiny model: each round's line, the medians, the ratio, with
the batch's decode where a request asks for more than 2 tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_a_burst_is_timed_served_and_in_process(tiny_path, tmp_path):
    cmd = [sys.executable, "-m", "tools.gpu.burst_paths", "--model-path", str(tiny_path("tiny-qwen35"))]
    cmd += ["--burst", "3", "--prompt-tokens", "12", "--rounds", "2", "--warmup", "off", "--tokens", "5"]
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for arm in ("served", "gateway"):
        for r in (1, 2):
            line = rf"^{arm} round {r}: TTFT p50 \d+ ms, p90 \d+, last \d+; decode gap p50 [0-9.]+ ms, p90 [0-9.]+, \d+ tok/s$"
            assert re.search(line, proc.stdout, re.M), proc.stdout
        assert re.search(rf"^{arm}: median over 2 rounds: TTFT p50 \d+ ms", proc.stdout, re.M), proc.stdout
    ratios = r"^served / gateway: p50 [0-9.]+x, p90 [0-9.]+x, last [0-9.]+x; decode gap p50 [0-9.]+x, p90 [0-9.]+x, tok/s [0-9.]+x$"
    assert re.search(ratios, proc.stdout, re.M), proc.stdout


def test_an_unknown_arm_is_refused():
    cmd = [sys.executable, "-m", "tools.gpu.burst_paths", "--arms", "served,vllm"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--arms takes served and gateway" in proc.stderr, proc.stderr
