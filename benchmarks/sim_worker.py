"""A simulated OpenAI worker for measuring the router alone (not a model).

It answers `/load` like a ready Baton worker and streams `--tokens` completion chunks
`--itl` seconds apart, in the exact SSE shape of a Baton worker, so that latency measured
through the router minus latency measured directly is the router's own cost, free of the
model's noise (the same idea as llm-d's inference simulator).

    python -m benchmarks.sim_worker --port 9001 --tokens 16 --itl 0.005
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

from baton.common.internal import WORKER_HEADER, worker_header

MODEL = "sim"


async def identify(request: web.Request, response: web.StreamResponse) -> None:
    """What every Baton worker names on its answers."""
    response.headers[WORKER_HEADER] = worker_header("sim-worker")


def build_app(tokens: int, itl: float) -> web.Application:
    async def load(_request):
        return web.json_response({"role": "both", "model": MODEL, "ready": True,
                                  "running": 0, "waiting": 0, "kv_blocks_used": 0,
                                  "kv_blocks_total": 1000, "max_waiting": 10000,
                                  "max_model_len": 4096})

    async def ready(_request):
        return web.json_response({"status": "ready"})

    async def completions(request):
        body = await request.json()
        base = {"id": "cmpl-sim", "object": "text_completion", "created": int(time.time()),
                "model": MODEL}
        if not body.get("stream"):
            await asyncio.sleep(itl * tokens)
            return web.json_response(base | {"choices": [{
                "index": 0, "text": "x" * tokens, "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                          "total_tokens": tokens + 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            await asyncio.sleep(itl)
            choice = {"index": 0, "text": "x", "logprobs": None,
                      "finish_reason": "length" if i == tokens - 1 else None}
            await resp.write(b"data: " + json.dumps(base | {"choices": [choice]}).encode()
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.on_response_prepare.append(identify)
    app.router.add_get("/load", load)
    app.router.add_get("/ready", ready)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--itl", type=float, default=0.005)
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(build_app(args.tokens, args.itl), host="127.0.0.1", port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
