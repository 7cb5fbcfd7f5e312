"""A minimal OpenAI-style streaming server for the harness's tests: it dies, caches prompts or stalls on purpose.

    python fake_server.py --port N [--exit-after K] [--break-after K] [--prompt-cache] [--stall K:SECONDS]

Answers /health, /v1/models, and /v1/completions with a fixed-length SSE stream. --exit-after K: the K-th completion
request writes one chunk, prints a message to stderr and exits 3. --break-after K: from the K-th completion request
on, as mlx-lm's server after its generation thread died: one error logged, then every request answered 404 with that
error, the server still up (each request also logged, as an access line). --prompt-cache: each response's usage
reports as cached the longest prefix its prompt shares with an earlier one (all but the last token at most, as a
prompt cache serves it). --stall K:SECONDS: the K-th completion request waits SECONDS after its second token.
"""

import argparse
import asyncio
import json
import os
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

args = argparse.ArgumentParser()
args.add_argument("--port", type=int, required=True)
args.add_argument("--exit-after", type=int, default=0)
args.add_argument("--break-after", type=int, default=0)
args.add_argument("--prompt-cache", action="store_true")
args.add_argument("--stall", default="0:0", metavar="K:SECONDS")
opts = args.parse_args()
stall_at, stall_s = int(opts.stall.split(":")[0]), float(opts.stall.split(":")[1])
seen = 0
prompts: list[list[int]] = []


async def health(request):
    return JSONResponse({"status": "ok"})


async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})


def cached_tokens(prompt: list[int]) -> int:
    def shared(other: list[int]) -> int:
        n = 0
        while n < min(len(prompt), len(other)) and prompt[n] == other[n]:
            n += 1
        return n

    return min(max((shared(p) for p in prompts), default=0), len(prompt) - 1)


async def completions(request):
    global seen
    seen += 1
    body = await request.json()
    if opts.break_after and seen >= opts.break_after:
        if seen == opts.break_after:
            print("RuntimeError: out of memory (the fake server breaks on purpose)", file=sys.stderr, flush=True)
        print('127.0.0.1 - - "POST /v1/completions HTTP/1.1" 404 -', file=sys.stderr, flush=True)
        return JSONResponse({"error": "generation thread died"}, status_code=404)
    n, dying, stalling = body["max_tokens"], seen == opts.exit_after, seen == stall_at
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
    if opts.prompt_cache:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens(body["prompt"])}
        prompts.append(body["prompt"])

    async def events():
        for i in range(n):
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}', 'finish_reason': None}]})}\n\n"
            if dying:
                print("fake server: exiting on purpose", file=sys.stderr, flush=True)
                os._exit(3)
            await asyncio.sleep(stall_s if stalling and i == 1 else 0.001)
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
)
uvicorn.run(app, host="127.0.0.1", port=opts.port, log_level="warning")
