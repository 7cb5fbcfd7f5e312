"""tools.gpu.prefill_kernels runs end to end on a tiny model: every shape and chunk timed, blocked and in turn."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says


@pytest.mark.parametrize("extra", [[], ["--interleave", "--clear", "--dense-min-rows", "16"]])
def test_every_shape_and_chunk_reports_a_time(tiny_path, extra):
    cmd = [
        sys.executable,
        "-m",
        "tools.gpu.prefill_kernels",
        "--model-path",
        str(tiny_path("tiny-qwen35")),
        "--shapes",
        "1x24,3x16",
        "--chunks",
        "2",
        "--reps",
        "1",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for shape in ("1x24", "3x16"):
        for chunk in (1, 2):
            assert re.search(rf"^prefill +{shape} +chunk {chunk}: +[0-9.]+ ms", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("bad", ["32", "0x64", "ax2"])
def test_a_bad_shape_is_refused(bad):
    cmd = [sys.executable, "-m", "tools.gpu.prefill_kernels", "--shapes", f"1x16,{bad}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "give GROUPxCHUNK" in proc.stderr, proc.stderr[-2000:]


def test_arms_alternate_in_one_process_and_each_gets_its_times_and_ratio(tiny_path):
    arms = "ENGINE_PREFILL_ATTENTION_KERNEL=0;ENGINE_PREFILL_ATTENTION_KERNEL=1 ENGINE_CHUNK_PREPARE_KERNEL=1"
    cmd = [sys.executable, "-m", "tools.gpu.prefill_kernels", "--model-path", str(tiny_path("tiny-qwen35"))]
    cmd += ["--shapes", "1x24,2x16", "--chunks", "2", "--reps", "2", "--arms", arms]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for i, label in enumerate(arms.split(";"), 1):
        assert re.search(rf"^arm {i} \({re.escape(label)}\): \w+ tier", out, re.M), out
        assert f"arm {i} ({label}):\n" in out, out
    assert len(re.findall(r"^prefill +(1x24|2x16) +chunk [12]: +[0-9.]+ ms", out, re.M)) == 8, out
    for shape in ("1x24", "2x16"):
        for chunk in (1, 2):
            assert re.search(rf"^arm 2 / arm 1: prefill {shape} chunk {chunk}: [0-9.]+x \(", out, re.M), out


@pytest.mark.parametrize(
    "arms, said",
    [
        ("ENGINE_NOT_A_SETTING=1;", "give NAME=VALUE settings"),
        ("ENGINE_KEEP_DENSE=2;", "ENGINE_KEEP_DENSE must be 0, 1 or auto"),
        ("ENGINE_KEEP_DENSE=1", "two arms or more"),
    ],
)
def test_bad_arms_are_refused_before_loading(arms, said):
    cmd = [sys.executable, "-m", "tools.gpu.prefill_kernels", "--model", "no-such-model", "--arms", arms]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-2000:]
