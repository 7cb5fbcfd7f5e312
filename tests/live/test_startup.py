"""`harness startup` end to end on a tiny model: starts, bursts after ready, lone rounds, a restart, no leftovers."""

import json
import subprocess
import sys

from processes import leftovers, new_tag, tagged_env

MODEL = "tiny-qwen35"


def test_startup_measures_the_starts_the_bursts_and_the_lone_lanes(tiny_path, tmp_path):
    tiny_path(MODEL)
    out, logs, tag = tmp_path / "startup.json", tmp_path / "logs", new_tag()
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "startup",
        "--models",
        MODEL,
        "--prompt-tokens",
        "24",
        "--tokens",
        "4",
        "--bursts",
        "3,5",
        "--lone-tokens",
        "6",
        "--rounds",
        "2",
        "--kernel-cache-dir",
        str(tmp_path / "kernels"),
        "--log-dir",
        str(logs),
        "--ttft-slo-ms",
        "60000",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=tagged_env(tag))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: the lone ratio's verdict, noisy on 2 shared cores
    (record,) = json.loads(out.read_text())
    assert [s["label"] for s in record["starts"]] == ["serial (--batch 1)", "start", "restart"]
    serial_cache = record["starts"][0]["command"][record["starts"][0]["command"].index("--kernel-cache-dir") + 1]
    assert serial_cache != str(tmp_path / "kernels")  # a directory of its own (--serial-kernel-cache own)
    assert all(s["load_to_ready_s"] > 0 and s["warmup"]["mode"] == "quick" for s in record["starts"])
    assert record["kernel_cache_dir"] == str(tmp_path / "kernels") and not record["errors"]
    bursts = {r["label"]: r for r in record["requests"] if r["label"] != "lone"}
    assert list(bursts) == ["first", "burst-3", "burst-5"]
    for label, n in (("first", 1), ("burst-3", 3), ("burst-5", 5)):
        assert bursts[label]["size"] == n and len(bursts[label]["ttft_ms"]) == n and not bursts[label]["errors"]
        assert bursts[label]["kernel_builds"] == 0  # the CPU runs none of the engine's CUDA kernels
        assert bursts[label]["compiled_modules"] == 0  # and compiles no module into the kernel cache
    assert len(record["lone"]["default_tps"]) == len(record["lone"]["serial_tps"]) == 2
    # MLX's memory at ready and its buffer cache after each lone round: what a lone row's allocations met
    assert all(s["memory"]["active_bytes"] > 0 for s in record["starts"])
    assert len(record["lone"]["default_cache_bytes"]) == 2
    assert all(isinstance(b, int) and b >= 0 for b in record["lone"]["default_cache_bytes"])
    assert (logs / "start" / "stderr.log").is_file() and (logs / "restart" / "stdout.log").is_file()
    assert "server starts" in proc.stdout and "paired ratio" in proc.stdout
    assert not leftovers(tag)


def test_the_serial_server_can_share_the_kernel_cache(tiny_path, tmp_path):
    tiny_path(MODEL)
    out, tag, kernels = tmp_path / "startup.json", new_tag(), str(tmp_path / "kernels")
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "startup",
        "--models",
        MODEL,
        "--prompt-tokens",
        "16",
        "--tokens",
        "2",
        "--bursts",
        "2",
        "--lone-tokens",
        "4",
        "--rounds",
        "1",
        "--no-restart",
        "--kernel-cache-dir",
        kernels,
        "--serial-kernel-cache",
        "shared",
        "--ttft-slo-ms",
        "60000",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=tagged_env(tag))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    (record,) = json.loads(out.read_text())
    for start in record["starts"]:
        assert start["command"][start["command"].index("--kernel-cache-dir") + 1] == kernels
    assert not leftovers(tag)
