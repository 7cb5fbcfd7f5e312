"""`engine serve --prompt-cache-dir`: a restart finds the entries the last server wrote at shutdown."""

from live_server import LiveServer

MODEL = "tiny-qwen35"
PROMPT = [3 + (i * 37) % 200 for i in range(400)]


def complete(srv):
    r = srv.client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_restart_with_the_same_directory_reuses_the_prompt(tiny_path, tmp_path):
    tiny_path(MODEL)
    args = ("--model", MODEL, "--prompt-cache-dir", str(tmp_path))
    first = LiveServer(*args)
    cold, cached = complete(first)
    code, out, err = first.stop()
    assert code == 0 and cached == 0 and "wrote 2 prompt cache entries to disk" in out, (out, err)
    again = LiveServer(*args)
    try:
        warm, cached = complete(again)
        assert cached == len(PROMPT) - 1 and warm == cold
        stats = again.stats()["prompt_cache"]
        assert stats["disk_hits"] == 1 and stats["disk_entries"] >= 2 and stats["disk_error"] is None
    finally:
        assert again.stop()[0] == 0
