"""The mlx-lm arm's server takes as many connections at once as the harness opens."""

import asyncio
import sys

import httpx

from harness.run.servers import free_port, start_server

AT_ONCE = 65  # the warmup phase of a run at 64 streams: one more than the largest concurrency


async def _streams(url: str, n: int) -> list[str]:
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": [5 + i, 6, 7], "max_tokens": 4, "stream": True, "temperature": 0}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = [line async for line in r.aiter_lines()]
            return "ok" if r.status_code == 200 and "data: [DONE]" in lines else f"status {r.status_code}"
        except httpx.HTTPError as e:  # a connection reset before mlx-lm accepted it
            return f"{type(e).__name__}: {e}"

    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*[one(client, i) for i in range(n)])


def test_sixty_five_streams_at_once_are_all_served(tiny_path):
    port = free_port()
    cmd = [sys.executable, "-m", "oracles.mlx_lm_server", "--model", str(tiny_path("tiny-qwen3")), "--port", str(port)]
    with start_server(cmd, port, timeout_s=300) as server:
        results = asyncio.run(_streams(server.url, AT_ONCE))
    assert [r for r in results if r != "ok"] == []
