"""The client's timing bookkeeping against a small in-test server with known timing, and
the summary / goodput arithmetic."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from baton_loadtest.client import ClientSettings, RequestRecord
from baton_loadtest.generator import PlannedRequest
from baton_loadtest.report import SLO, compare, summarize
from baton_loadtest.runner import run_plan
from baton_loadtest.spec import ArrivalSpec, WorkloadSpec

# The server waits FIRST before the first token, then GAPS between the next ones.
FIRST, GAPS = 0.20, [0.05, 0.15, 0.10]


def _chunk(text: str, final: bool = False) -> bytes:
    c = {"choices": [{"index": 0, "delta": {"content": text},
                      "finish_reason": "length" if final else None}]}
    return b"data: " + json.dumps(c).encode() + b"\n\n"


async def chat(request):
    body = await request.json()
    if body["messages"][-1]["content"] == "fail":
        return web.json_response({"error": {"message": "nope"}}, status=500)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk("", False).replace(b'"content": ""', b'"role": "assistant"'))
    if body["messages"][-1]["content"] == "drop":
        await asyncio.sleep(0.05)
        request.transport.close()
        return resp
    await asyncio.sleep(FIRST)
    await resp.write(_chunk("a"))
    for i, gap in enumerate(GAPS):
        await asyncio.sleep(gap)
        await resp.write(_chunk("b", final=i == len(GAPS) - 1))
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    return resp


@pytest.fixture(scope="module")
def server():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def _req(i: int, text: str) -> PlannedRequest:
    return PlannedRequest(i, [{"role": "user", "content": text}], text, 4, arrival_s=0.0)


def test_ttft_and_every_gap_are_recorded(server):
    spec = WorkloadSpec(num_requests=3, arrival=ArrivalSpec(process="poisson", rate=100))
    reqs = [_req(0, "hi"), _req(1, "fail"), _req(2, "drop")]
    records, wall = asyncio.run(run_plan(spec, reqs, None, ClientSettings(server, "m"),
                                         progress=False))
    ok, failed, dropped = records
    assert ok.ok and ok.status == 200
    assert ok.ttft_s == pytest.approx(FIRST, abs=0.03)
    assert ok.itl_s == pytest.approx(GAPS, abs=0.03)
    assert ok.e2e_s == pytest.approx(FIRST + sum(GAPS), abs=0.05)
    assert (ok.prompt_tokens, ok.output_tokens) == (7, 4)
    assert ok.tpot_s == pytest.approx(sum(GAPS) / 3, abs=0.02)
    assert not failed.ok and failed.status == 500 and "nope" in failed.error
    assert not dropped.ok and dropped.error
    assert wall >= FIRST + sum(GAPS)


def _rec(i, ttft, itl, e2e, ok=True):
    return RequestRecord(i, 0.0, ok=ok, status=200, ttft_s=ttft, itl_s=itl, e2e_s=e2e,
                         prompt_tokens=10, output_tokens=len(itl) + 1)


def test_summary_percentiles_and_goodput():
    recs = [_rec(i, 0.1 * (i + 1), [0.01] * 4, 1.0) for i in range(10)]
    recs.append(_rec(10, 0.05, [0.01, 0.5], 1.0))  # one slow gap
    recs.append(_rec(11, None, [], None, ok=False))
    s = summarize(recs, wall_s=2.0, slo=SLO(ttft_s=0.55, itl_s=0.2))
    assert (s["requests"], s["ok"], s["errors"]) == (12, 11, 1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["ttft_s"]["max"] == pytest.approx(1.0)
    assert s["good"] == 5  # ttft 0.1..0.5; the slow-gap one and the failed one miss
    assert s["goodput"] == pytest.approx(2.5)
    assert s["goodput_ratio"] == pytest.approx(5 / 12)
    assert s["output_tokens"] == 10 * 5 + 3
    table = compare(s, s | {"request_throughput": s["request_throughput"] * 2})
    assert "| req/s |" in table and "2.00x" in table
