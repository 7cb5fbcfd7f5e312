"""`engine serve --prefill-itl`: a long prompt joining a decoding stream is paced, and /stats shows what the pacer
measured (the bound itself is held in tests/unit/test_prefill_pacing.py, on a simulated clock)."""

import threading

from live_server import LiveServer

MODEL = "tiny-qwen35"


def test_a_paced_server_measures_its_steps_and_prompt_tokens(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL, "--prefill-itl", "3", "--prefill-budget", "2048")
    try:
        assert srv.stats()["batch"]["prefill_pacing"] == {
            "ratio": 3.0,
            "decode_step_ms": {},
            "prompt_token_ms": None,
            "smallest_prefill": None,
            "larger_prefill_token_ms": None,
        }
        decoding, started = {}, threading.Event()

        def long_stream():  # a row decoding before the long prompt arrives
            body = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
            with srv.client.stream("POST", "/v1/completions", json=body) as r:
                decoding["status"] = r.status_code
                decoding["events"] = 0
                for line in r.iter_lines():
                    decoding["events"] += line.startswith("data: ")
                    if decoding["events"] == 3:
                        started.set()
            started.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(timeout=60)
        prompt = [3 + (i * 37) % 200 for i in range(1500)]
        r = srv.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        t.join()
        assert r.status_code == decoding["status"] == 200 and decoding["events"] > 300
        pacing = srv.stats()["batch"]["prefill_pacing"]
        assert pacing["ratio"] == 3.0 and pacing["decode_step_ms"] and pacing["prompt_token_ms"] is not None
        assert pacing["smallest_prefill"]["tokens"] >= 1 and pacing["smallest_prefill"]["ms"] >= 0
    finally:
        assert srv.stop()[0] == 0
