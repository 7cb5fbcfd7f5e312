"""`engine serve --warmup` and `--decode-buckets`: what ran before ready, and the shapes first run after it."""

import pytest
from live_server import LiveServer

from harness.run.servers import tail

MODEL = "tiny-qwen35"


@pytest.fixture(scope="module")
def server(tiny_path):
    tiny_path(MODEL)
    srv = LiveServer("--model", MODEL, "--batch", "8", "--warmup", "full", "--decode-buckets", "1,2,4,8")
    yield srv
    assert srv.stop()[0] == 0


def test_the_full_warmup_runs_every_bucket_before_ready(server):
    stats = server.stats()
    warm, shapes = stats["warmup"], stats["shapes"]
    assert warm["mode"] == "full" and warm["requests"] == 2 + 8 and warm["seconds"] > 0
    assert shapes["decode_buckets"] == [1, 2, 4, 8] and shapes["new_since_ready"] == 0
    # the CPU runs none of the engine's CUDA kernels: nothing to build
    assert shapes["kernel_builds"] == shapes["kernel_builds_since_ready"] == warm["kernel_builds"] == 0
    assert stats["compiled_modules"]["since_ready"] == 0  # the kernel cache directory's modules (none on the CPU)
    assert [st["name"] for st in warm["stages"]] == ["decode rows 1-10"]
    ready = tail(server.server.stdout_path).splitlines()[0]
    assert "batch 8, decode buckets 1,2,4,8," in ready and "warm-up full" in ready
    assert "engine serve: warm-up decode rows 1-10: 10 requests" in tail(server.server.stderr_path)
    memory = stats["memory"]  # MLX's: the model's weights at least, alive since the load
    assert memory["peak_bytes"] >= memory["active_bytes"] > 0 and memory["cache_bytes"] >= 0
    assert memory["host_allocator"] == ready.rsplit("allocator ", 1)[1].rstrip(")")  # as the ready line says


def test_a_new_shape_after_ready_is_counted(server):
    before = server.stats()["shapes"]["new_since_ready"]
    r = server.client.post(
        "/v1/completions", json={"prompt": list(range(5, 5 + 37)), "max_tokens": 3, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    after = server.stats()["shapes"]
    assert after["new_since_ready"] > before  # a 37-token prompt chunk the warm-up never ran
    assert after["seen"] == server.stats()["warmup"]["shapes"] + after["new_since_ready"]
