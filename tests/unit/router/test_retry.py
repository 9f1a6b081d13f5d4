"""The retry loop and the relay through a real router in front of fake workers: retries
before the first byte, the last worker's own answer, a decode stream resumed on another
decode pod, and live tuning reaching the next request."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from baton.common.internal import GenerateRequest, ResumeState
from baton.common.tuning import parse_tuning
from baton.router.app import ROUTER
from tests.unit.router.fakes import (
    HEADER,
    FakePod,
    chat,
    content,
    metric,
    post,
    start,
    stop,
    stream,
    tokens,
)


def test_a_failed_attempt_moves_to_another_worker():
    calls = []

    async def first_fails(pod: FakePod, request: web.Request, body: bytes):
        calls.append(pod)
        if len(calls) == 1:
            return web.json_response({"error": "down"}, status=500)
        return web.json_response({"choices": [], "answer": pod.url})

    async def main():
        router, pods = await start(FakePod("both", first_fails), FakePod("both", first_fails))
        status, _, body = await post(router, chat())
        assert status == 200 and json.loads(body)["answer"] == calls[1].url
        assert calls[0] is not calls[1]  # never the same worker twice
        assert json.loads(calls[0].bodies[0]) == chat()  # the client's body, as it came
        assert metric(router, "baton:router_retries_total") == 1
        assert metric(router, "baton:router_upstream_errors_total", upstream=calls[0].url,
                      reason="status 500") == 1
        assert router.app[ROUTER].discovery.endpoints[calls[0].url].consecutive_failures == 1
        await stop(router, pods)
    asyncio.run(main())


def test_when_every_worker_refuses_the_last_answer_goes_back():
    async def full(pod: FakePod, request: web.Request, body: bytes):
        return web.json_response({"error": "queue full"}, status=429,
                                 headers={"Retry-After": "3"})

    async def main():
        router, pods = await start(FakePod("both", full), FakePod("both", full))
        status, headers, _ = await post(router, chat())
        assert status == 429 and headers["Retry-After"] == "3"
        assert sum(len(p.bodies) for p in pods) == 2  # max_attempts 3, but only 2 workers
        # A reload reaches the next request: one attempt only.
        router.app[ROUTER].apply_tuning(parse_tuning("router: {max_attempts: 1}"))
        status, _, _ = await post(router, chat())
        assert status == 429 and sum(len(p.bodies) for p in pods) == 3
        await stop(router, pods)
    asyncio.run(main())


def test_a_decode_stream_that_breaks_is_resumed_on_another_decode_pod():
    async def dies_unless_resumed(pod: FakePod, request: web.Request, body: bytes):
        call = GenerateRequest.model_validate_json(body)
        if call.resume is None:  # the first pod: dies after "Hel", with [6]'s event pending
            return await stream(request, tokens(prompt_token_ids=[1, 2, 3], header=HEADER),
                                content("", role="assistant"), tokens([5], 3),
                                content("Hel"), tokens([6], 2), die=True)
        return await stream(request, tokens(prompt_token_ids=[1, 2, 3, 5], header=HEADER),
                            tokens([6], 2), content("lo"), tokens([7], finished=True),
                            content("", "stop"), b"data: [DONE]\n\n")

    async def main():
        router, pods = await start(FakePod("decode", dies_unless_resumed),
                                   FakePod("decode", dies_unless_resumed))
        status, _, body = await post(router, chat(stream=True, max_tokens=8),
                                     **{"X-Baton-Timing": "1"})
        assert status == 200
        assert body.encode() == (content("", role="assistant") + content("Hel")
                                 + content("lo") + content("", "stop") + b"data: [DONE]\n\n")
        sent = [GenerateRequest.model_validate_json(b) for p in pods for b in p.bodies]
        start_call, resumed = sorted(sent, key=lambda c: c.resume is not None)
        assert start_call.return_token_ids and start_call.request.max_tokens == 8
        assert resumed.prompt_token_ids == [1, 2, 3, 5]  # [6] never reached the client
        assert resumed.request.max_tokens == 7 and resumed.return_token_ids
        assert resumed.resume == ResumeState(prompt_tokens=3, completion_tokens=1,
                                             text_offset=3, created=7)
        assert all(p.headers[0]["X-Baton-Timing"].startswith("router_queue=") and
                   p.headers[0]["X-Baton-Timing"].endswith(",prefill=0.000000")
                   for p in pods)
        assert metric(router, "baton:fallbacks_total", reason="decode_lost") == 1
        assert sum(metric(router, "baton:router_upstream_errors_total", upstream=p.url,
                          reason="mid-stream") for p in pods) == 1
        await stop(router, pods)
    asyncio.run(main())


def test_a_stream_that_breaks_with_no_decode_pod_left_ends_in_band():
    async def dies(pod: FakePod, request: web.Request, body: bytes):
        return await stream(request, tokens(prompt_token_ids=[1], header=HEADER),
                            content("", role="assistant"), tokens([5], 1), content("a"),
                            die=True)

    async def main():
        router, pods = await start(FakePod("decode", dies))
        status, _, body = await post(router, chat(stream=True))
        events = [e for e in body.split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "upstream_failed" and "baton.tokens" not in body
        await stop(router, pods)
    asyncio.run(main())


def test_a_failure_the_request_caused_is_final_and_a_408_is_retried():
    async def answers(pod: FakePod, request: web.Request, body: bytes):
        if pod.mode == "bad request":
            return web.json_response({"error": {"message": "bad"}}, status=400)
        if pod.mode == "engine refused it":
            return web.json_response({"error": {"message": "no"}}, status=500,
                                     headers={"X-Baton-No-Retry": "1"})
        return web.json_response({"error": {"message": "slow"}}, status=408)

    async def main():
        router, pods = await start(FakePod("both", answers), FakePod("both", answers))
        for mode, status, calls in [("bad request", 400, 1), ("engine refused it", 500, 1),
                                    ("timeout", 408, 2)]:
            for pod in pods:
                pod.mode, pod.bodies = mode, []
            answered, _, body = await post(router, chat())
            assert answered == status, mode
            assert sum(len(p.bodies) for p in pods) == calls, mode
        assert metric(router, "baton:router_retries_total") == 1  # the 408 only
        assert all(e.consecutive_failures == 0 for e in router.app[ROUTER].discovery.all())
        await stop(router, pods)
    asyncio.run(main())
