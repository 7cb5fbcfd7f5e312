"""Eight concurrent streams on `--batch 8` give the same tokens as the same requests one at a time on `--batch 1`."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from live_server import LiveServer, stream

MODEL = "tiny-qwen35"


@pytest.fixture(scope="module")
def servers(tiny_path):
    tiny_path(MODEL)
    batched, serial = LiveServer("--model", MODEL, "--batch", "8"), LiveServer("--model", MODEL, "--batch", "1")
    yield batched, serial
    codes = [batched.stop()[0], serial.stop()[0]]
    assert codes == [0, 0]


def requests():
    # Distinct first tokens: no request can reuse another's prompt cache entry.
    return [
        {
            "prompt": [100 + i] + [(37 * i + 11 * j) % 3000 + 5 for j in range(6 + 9 * i)],
            "max_tokens": 12 + 2 * i,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(8)
    ]


def run(server, body):
    events, done = stream(server.client, "/v1/completions", body)
    assert done
    ids = sum((e["choices"][0]["token_ids"] for e in events if e["choices"]), [])
    return ids, events[-1]["usage"]


def test_eight_concurrent_streams_equal_one_at_a_time(servers):
    batched, serial = servers
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: run(batched, b), requests()))
    alone = [run(serial, b) for b in requests()]
    for i, ((ids, usage), (want, serial_usage)) in enumerate(zip(together, alone)):
        assert len(ids) == requests()[i]["max_tokens"]
        assert ids == want, f"request {i}"
        assert usage["engine"]["lane"] == "continuous" and serial_usage["engine"]["lane"] == "serial"
    assert max(u["engine"]["batch_size"] for _, u in together) > 1  # they really ran together
    assert batched.stats()["batch"]["active_rows"] == 0
