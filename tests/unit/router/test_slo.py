"""Latency where the client is: the router's TTFT, ITL and E2E histograms, by model,
decision (remote prefill or local) and tenant, for streamed and whole answers."""

from __future__ import annotations

import asyncio

from aiohttp import web

from baton.router.scheduling.disagg import DisaggSettings
from tests.unit.router.fakes import (
    FakePod,
    chat,
    content,
    metric,
    post,
    prefill_answer,
    start,
    stop,
)

TTFT = "baton:router_time_to_first_token_seconds"
ITL = "baton:router_inter_token_latency_seconds"
E2E = "baton:router_e2e_request_latency_seconds"


async def slow_stream(pod: FakePod, request: web.Request, body: bytes):
    """The role chunk at once, then two tokens 0.1 s apart (the first after 0.1 s)."""
    if b'"stream": true' not in body and b'"stream":true' not in body:
        await asyncio.sleep(0.1)
        return web.json_response({"id": "c", "choices": []})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(content("", role="assistant"))
    for text in ("Hel", "lo"):
        await asyncio.sleep(0.1)
        await resp.write(content(text))
    await resp.write(content("", "stop") + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def series(router, name: str, decision: str = "local", **labels) -> float:
    return metric(router, name, model="m", decision=decision, tenant="default", **labels)


def test_a_stream_is_timed_from_arrival_to_its_first_token_and_between_tokens():
    async def main():
        router, pods = await start(FakePod("both", slow_stream))
        status, _, body = await post(router, chat(stream=True))
        assert status == 200 and body.endswith("data: [DONE]\n\n")
        assert series(router, TTFT + "_count") == 1
        assert 0.1 <= series(router, TTFT + "_sum") < 0.19  # not the role chunk's time
        assert series(router, ITL + "_count") >= 1  # "lo" (and the finish, if apart)
        assert 0.09 <= series(router, ITL + "_sum") < 0.3
        assert 0.2 <= series(router, E2E + "_sum") < 0.4
        await stop(router, pods)
    asyncio.run(main())


def test_a_whole_answer_has_one_time_and_no_inter_token_latency():
    async def main():
        router, pods = await start(FakePod("both", slow_stream))
        assert (await post(router, chat()))[0] == 200
        assert series(router, TTFT + "_count") == 1 == series(router, E2E + "_count")
        assert series(router, TTFT + "_sum") >= 0.1
        assert series(router, ITL + "_count") == 0
        await stop(router, pods)
    asyncio.run(main())


async def disaggregated(pod: FakePod, request: web.Request, body: bytes):
    if request.path == "/internal/prefill":
        return web.Response(body=prefill_answer([1, 2]).model_dump_json(),
                            content_type="application/json")
    if pod.fail:
        return web.json_response({"error": {"message": "no"}}, status=400)
    return web.json_response({"id": "c", "choices": []})


def test_the_decision_is_a_label_and_errors_are_not_observed():
    async def main():
        prefill, decode = FakePod("prefill", disaggregated), FakePod("decode", disaggregated)
        decode.fail = False
        router, pods = await start(prefill, decode, disagg=DisaggSettings(
            min_prefill_tokens=0))
        assert (await post(router, chat()))[0] == 200
        assert series(router, E2E + "_count", decision="remote") == 1
        assert series(router, E2E + "_count", decision="local") == 0
        decode.fail = True
        assert (await post(router, chat()))[0] == 400
        assert series(router, E2E + "_count", decision="remote") == 1
        assert metric(router, "baton:router_requests_total", code="400",
                      tenant="default") == 1
        await stop(router, pods)
    asyncio.run(main())
