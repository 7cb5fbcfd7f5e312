"""A minimal OpenAI-style streaming server that dies on purpose, for the harness's failure tests.

    python fake_server.py --port N --exit-after K

Answers /health, and /v1/completions with a fixed-length SSE stream; the K-th
completion request writes one chunk, prints a message to stderr and exits 3.
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
args.add_argument("--exit-after", type=int, required=True)
opts = args.parse_args()
seen = 0


async def health(request):
    return JSONResponse({"status": "ok"})


async def completions(request):
    global seen
    seen += 1
    body = await request.json()
    n, dying = body["max_tokens"], seen >= opts.exit_after

    async def events():
        for i in range(n):
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}', 'finish_reason': None}]})}\n\n"
            if dying:
                print("fake server: exiting on purpose", file=sys.stderr, flush=True)
                os._exit(3)
            await asyncio.sleep(0.001)
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": len(body["prompt"]) + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=opts.port, log_level="warning")
