"""Real third-party clients driving `engine serve` on trained-qwen3 (the `clients` marker, left out of the default run).

    pytest -m clients tests/clients

The libraries (tests/clients/requirements.txt) are installed on first use into a venv of their own,
`clients-venv` under the model cache (ENGINE_HARNESS_CACHE, else ~/.cache/engine-harness), and again when that
file changes; never into the project's. Each client runs in a subprocess with the HF hub offline, against one
server per module, through tools/capture_clients.py: a test fails when the client fails, when the server refused
any of its requests (the failure names them and the server's reason), or when the result does not parse.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.env import cache_root, trained_dir
from harness.run.servers import engine_serve_command, free_port, start_server

pytestmark = pytest.mark.clients

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "clients"
REQUIREMENTS = HERE / "requirements.txt"
MODEL = "trained-qwen3"  # its own chat template renders tools and writes <tool_call> JSON blocks
TOKENIZER = trained_dir() / MODEL
CLIENT_TIMEOUT_S = 600


def clients_bin() -> Path:
    """The clients venv's bin/, built (under a lock, for xdist workers) when its requirements changed."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "clients-venv"
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    stamp = venv / "requirements.sha256"
    with open(root / "clients-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists() or stamp.read_text() != want:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)]
            install = subprocess.run(pip, check=False, capture_output=True, text=True, timeout=1800)
            assert install.returncode == 0, f"installing {REQUIREMENTS} failed:\n{install.stderr[-3000:]}"
            stamp.write_text(want)
    return venv / "bin"


@dataclass
class Served:
    """The server behind the capturing proxy: `url` is the proxy's; `log` has one JSON line per request."""

    url: str
    log: Path

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    return clients_bin()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port, proxy_port = free_port(), free_port()
    server = start_server(engine_serve_command(["--model", MODEL], port), port, timeout_s=180)
    log = tmp_path_factory.mktemp("captured") / "requests.jsonl"
    proxy_cmd = [
        sys.executable,
        str(ROOT / "tools" / "capture_clients.py"),
        "--upstream",
        server.url,
        "--port",
        str(proxy_port),
        "--log",
        str(log),
    ]
    try:
        proxy = start_server(proxy_cmd, proxy_port, timeout_s=60)
    except BaseException:
        server.stop()
        raise
    yield Served(proxy.url, log)
    proxy.stop()
    assert server.stop() == 0


def refusal(record: dict) -> str:
    body = record["body"] if isinstance(record["body"], dict) else {}
    reason = (record.get("response") or {}).get("error", {}).get("message") if record.get("response") else None
    return f"{record['method']} {record['path']} -> {record['status']}: {reason} (body keys {sorted(body)})"


def run_client(served: Served, argv: list, cwd: Path) -> subprocess.CompletedProcess:
    """Run a client to its end; fails on its exit status or on any request the server refused."""
    seen = len(served.records())
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HOME": str(cwd / "hf-home"),
    }
    proc = subprocess.run(
        [str(a) for a in argv], check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
    )
    refused = [r for r in served.records()[seen:] if r["status"] >= 400]
    report = "\n".join([*map(refusal, refused[:5]), f"exit {proc.returncode}; stderr tail:", proc.stderr[-2500:]])
    assert proc.returncode == 0 and not refused, report
    return proc


def drive(bin_dir: Path, served: Served, scenario: str, cwd: Path) -> dict:
    """One scenario of drive.py (a library used as its documentation does): its JSON result."""
    argv = [bin_dir / "python", HERE / "drive.py", scenario, "--base-url", served.url, "--model", MODEL]
    return json.loads(run_client(served, argv, cwd).stdout.splitlines()[-1])


# guidellm: its default backend (chat completions, streamed) on synthetic prompts, short runs.


@pytest.mark.parametrize(
    "profile, count", [("kind=synchronous", 4), ("kind=concurrent,streams=4", 8)], ids=["synchronous", "concurrent"]
)
def test_guidellm_benchmark_has_no_errors(bin_dir, served, tmp_path, profile, count):
    out = tmp_path / "guidellm.json"
    run_client(
        served,
        [
            bin_dir / "guidellm",
            "run",
            "--backend",
            f"kind=openai_http,target={served.url},model={MODEL}",
            "--profile",
            profile,
            "--constraint",
            f"kind=max_requests,count={count}",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
            "--tokenizer",
            f"kind=huggingface_auto,model={TOKENIZER}",
            "--output",
            f"kind=json,path={out}",
            "--disable-progress",
        ],
        tmp_path,
    )
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == count, totals


# lm-eval local-completions at batch size 4, on local copies of lambada_openai, arc_easy and gsm8k.


@pytest.mark.parametrize(
    "task, metric",
    [("engine_lambada", "acc,none"), ("engine_arc_easy", "acc,none"), ("engine_gsm8k", "exact_match,flexible-extract")],
    ids=["loglikelihood", "multiple_choice", "generate_until"],
)
def test_lm_eval_local_completions_at_batch_size_4(bin_dir, served, tmp_path, task, metric):
    model_args = (
        f"model={MODEL},base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={TOKENIZER},max_retries=1"
    )
    run_client(
        served,
        [
            bin_dir / "lm-eval",
            "run",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--batch_size",
            "4",
            "--include_path",
            FIXTURES / "lm_eval",
            "--tasks",
            task,
            "--limit",
            "4",
            "--output_path",
            tmp_path / "out",
        ],
        tmp_path,
    )
    (results_path,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(results_path.read_text())
    assert results["n-samples"][task]["effective"] == 4
    assert 0 <= results["results"][task][metric] <= 1
    if task == "engine_lambada":
        assert math.isfinite(results["results"][task]["perplexity,none"])


# The agent and structured-output libraries, through drive.py.


def test_openai_agents_with_reasoning_settings(bin_dir, served, tmp_path):
    result = drive(bin_dir, served, "openai_agents_reasoning", tmp_path)
    assert isinstance(result["final_output"], str)


def test_openai_agents_with_a_forced_tool(bin_dir, served, tmp_path):
    result = drive(bin_dir, served, "openai_agents_forced_tool", tmp_path)
    assert result["tool_calls"] == ["get_weather"] and isinstance(result["final_output"], str)


@pytest.mark.parametrize("mode", ["json_schema", "tools"])
def test_instructor_returns_the_response_model(bin_dir, served, tmp_path, mode):
    forecast = drive(bin_dir, served, f"instructor_{mode}", tmp_path)["forecast"]
    assert forecast["city"] in ("Oslo", "Paris") and 1 <= forecast["days"] <= 7


def test_pydantic_ai_with_a_tool_and_native_output(bin_dir, served, tmp_path):
    output = drive(bin_dir, served, "pydantic_ai_native_output_tool", tmp_path)["output"]
    assert output["city"] in ("Oslo", "Paris") and 1 <= output["days"] <= 7


def test_langchain_openai_with_a_forced_tool(bin_dir, served, tmp_path):
    calls = drive(bin_dir, served, "langchain_forced_tool", tmp_path)["tool_calls"]
    assert calls and all(c["name"] == "get_weather" and isinstance(c["args"].get("city"), str) for c in calls)


# The captured requests themselves, replayed: no client library needed.


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_a_captured_request_is_served(served, path):
    fixture = json.loads(path.read_text())
    body = fixture["body"]
    with httpx.Client(base_url=served.url, timeout=120) as client:
        r = client.request(fixture["method"], fixture["path"], json=body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]
        elif isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], (list, str)):
            assert len(r.json()["choices"]) == len(body["prompt"])  # one choice per prompt of the batch
