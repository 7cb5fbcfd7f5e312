"""tools.gpu.first_prompts runs end to end on a tiny model: every phase reports each length; the prompt cache is
the one asked for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


def test_every_phase_reports_the_first_prompt_and_the_following(tiny_path, tmp_path):
    cmd = [sys.executable, "-m", "tools.gpu.first_prompts", "--model-path", str(tiny_path("tiny-qwen35"))]
    cmd += ["--warmup", "quick", "--lengths", "20,40", "--repeats", "1", "--refill", "64"]
    cmd += ["--prompt-cache-block", "16"]
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^warm-up quick: .* blocks of 16$", proc.stdout, re.M), proc.stdout
    for phase in ("after ready", "cache emptied", r"refilled \(64 tokens\)"):
        for n in (20, 40):
            line = rf"^{phase}: {n} tokens: first [0-9]+ ms, then [0-9]+ ms \(median of 1\), [0-9.]+x"
            assert re.search(line, proc.stdout, re.M), (phase, n, proc.stdout)
