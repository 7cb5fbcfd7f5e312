"""tools.gpu.lone_lanes runs end to end on a tiny model: every arm, the warm-up, a burst and a reset."""

from __future__ import annotations

import re

from tools.gpu import lone_lanes


def test_every_arm_and_phase_reports_a_rate(tiny_path, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    lone_lanes.main(["--model-path", str(tiny_path("tiny-qwen35")), "--rounds", "1", "--tokens", "6",
                     "--prompt-tokens", "9", "--warmup", "quick", "--burst", "3", "--reset"])  # fmt: skip
    out = capsys.readouterr().out
    for phase in ("fresh", "after a burst of 3", "reset"):
        for arm in ("generate", "runner", "serial", "continuous"):
            assert re.search(rf"^{phase} +{arm}: median [0-9.]+ tok/s", out, re.M), (phase, arm, out)
