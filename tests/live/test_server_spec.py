"""`engine serve --draft-model / --draft-kind`: speculative requests through the real server."""

import subprocess
import sys

import pytest
from live_server import LiveServer, stream

from engine.engine import Engine

MODEL = "tiny-qwen35"


@pytest.fixture(scope="module")
def engine(tiny_path):
    return Engine.load(model_path=tiny_path(MODEL))


def complete(srv, body):
    r = srv.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_draft_model_requests_run_on_the_spec_lane_with_plain_greedy_output(engine):
    srv = LiveServer("--model", MODEL, "--draft-model", "tiny-qwen35-draft", "--num-draft-tokens", "2")
    try:
        prompt = list(range(300, 340))
        expected = [t.token_id for t in engine.generate(prompt, max_tokens=24, ignore_eos=True)]
        out = complete(srv, {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True})
        assert out["choices"][0]["token_ids"] == expected
        ext = out["usage"]["engine"]
        assert ext["lane"] == "spec" and "draft" in ext["lane_reason"] and ext["batch_size"] == 1
        spec = ext["spec"]
        assert spec["kind"] == "draft" and spec["num_draft"] == 2
        assert spec["accepted"] + spec["rejected"] == spec["drafted"] > 0
        assert sum(spec["accepted_per_position"]) == spec["accepted"]
        assert spec["target_calls"] == spec["rounds"] + spec["replays"]

        # Streaming: one chunk per token, the same tokens, usage last.
        events, done = stream(
            srv.client,
            "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": 24,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert done
        ids = [i for e in events for c in e["choices"] for i in c.get("token_ids") or []]
        assert ids == expected
        assert events[-1]["usage"]["engine"]["lane"] == "spec"

        # Penalties cannot speculate: the request runs on a plain lane and says why.
        out = complete(srv, {"prompt": prompt, "max_tokens": 4, "repetition_penalty": 1.3})
        assert out["usage"]["engine"]["lane"] != "spec"
        assert "logits processors" in out["usage"]["engine"]["lane_reason"]
        totals = srv.stats()["totals"]  # two spec requests; the adaptive policy's draft counts depend on timings
        assert totals["spec_drafted"] > spec["drafted"] and totals["spec_rounds"] > spec["rounds"]
    finally:
        code, stdout, _ = srv.stop()
        assert code == 0
        assert "speculation draft (tiny-qwen35-draft)" in stdout


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_model_free_and_mtp_kinds_serve(engine, kind):
    srv = LiveServer("--model", MODEL, "--draft-kind", kind)
    try:
        prompt = list(range(300, 330)) * 2
        expected = [t.token_id for t in engine.generate(prompt, max_tokens=16, ignore_eos=True)]
        out = complete(srv, {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True})
        assert out["choices"][0]["token_ids"] == expected
        assert out["usage"]["engine"]["spec"]["kind"] == kind
        # a next turn starts from the first one's prompt boundary (the MTP head from its state stored there)
        longer = prompt + [7, 8, 9]
        out = complete(srv, {"prompt": longer, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True})
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        assert out["choices"][0]["token_ids"] == [
            t.token_id for t in engine.generate(longer, max_tokens=16, ignore_eos=True)
        ]
    finally:
        assert srv.stop()[0] == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft-kind", "mtp", "--model", "tiny-qwen3"], "MTP head"),
        (["--draft-model-path", "FOREIGN", "--model", MODEL], "another tokenizer"),
        (["--draft-kind", "draft", "--model", MODEL], "needs exactly one of"),
        (["--draft-kind", "ngram", "--ngram-min", "5", "--ngram-max", "2", "--model", MODEL], "n-gram sizes"),
    ],
)
def test_bad_speculation_settings_fail_at_startup_with_the_reason(flags, message, foreign_tokenizer_draft):
    flags = [str(foreign_tokenizer_draft) if f == "FOREIGN" else f for f in flags]
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


@pytest.mark.parametrize(
    "kind, flags", [("ngram", ["--draft-kind", "ngram"]), ("draft", ["--draft-model", "tiny-qwen3-draft-f32"])]
)
def test_spec_batch_runs_concurrent_requests_as_spec_rows_in_the_continuous_batch(tiny_path, kind, flags):
    from concurrent.futures import ThreadPoolExecutor

    dense = Engine.load(model_path=tiny_path("tiny-qwen3-f32"))  # f32: no exact ties between the top two
    srv = LiveServer("--model", "tiny-qwen3-f32", *flags, "--num-draft-tokens", "2", "--spec-batch")
    try:
        prompts = [list(range(300 + 7 * i, 330 + 7 * i)) * 2 for i in range(3)]
        body = {"max_tokens": 32, "ignore_eos": True, "return_token_ids": True}
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: complete(srv, {**body, "prompt": p}), prompts))
        for prompt, out in zip(prompts, outs):
            expected = [t.token_id for t in dense.generate(prompt, max_tokens=32, ignore_eos=True)]
            assert out["choices"][0]["token_ids"] == expected
            ext = out["usage"]["engine"]
            assert ext["lane"] == "continuous" and "in the continuous batch" in ext["lane_reason"]
            assert ext["spec"]["kind"] == kind and ext["spec"]["rounds"] > 0
        assert max(out["usage"]["engine"]["batch_size"] for out in outs) > 1
    finally:
        code, _, _ = srv.stop()
        assert code == 0
