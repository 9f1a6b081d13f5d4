"""Disaggregated requests through a real router in front of a fake prefill pod and a fake
decode pod: the typed bodies each gets, and every fallback to a local prefill."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from baton.common.internal import GenerateRequest, PrefillRequest
from baton.router.app import ROUTER
from baton.router.scheduling.disagg import DisaggSettings
from tests.unit.router.fakes import (
    FakePod,
    chat,
    metric,
    post,
    prefill_answer,
    start,
    stop,
    stream,
    tokens,
)

ANSWER = prefill_answer([1, 2, 3, 4])


async def prefill_pod(pod: FakePod, request: web.Request, body: bytes):
    mode = pod.mode
    if mode == "slow":
        await asyncio.sleep(1.0)
    if mode == "hang":  # until the client leaves, or the test ends
        await until_gone_or(pod, request)
    if mode == "error":
        return web.json_response({"error": "boom"}, status=500)
    if mode == "refuse":
        return web.json_response({"error": {"message": "the prompt is too long", "type":
                                            "invalid_request_error", "param": "messages",
                                            "code": "context_length_exceeded"}}, status=400)
    if mode == "engine refused it":
        return web.json_response({"error": {"message": "no"}}, status=500,
                                 headers={"X-Baton-No-Retry": "1"})
    if mode == "garbage":
        return web.json_response({"prompt_token_ids": "nope"})
    return web.Response(body=ANSWER.model_dump_json(), content_type="application/json")


async def decode_pod(pod: FakePod, request: web.Request, body: bytes):
    if pod.mode == "hang":
        await until_gone_or(pod, request)
    if json.loads(body)["request"].get("stream"):
        return await stream(request, tokens([7], chars=1, finished=True), b"data: [DONE]\n\n")
    return web.json_response({"id": "chatcmpl-1", "choices": []})


async def until_gone_or(pod: FakePod, request: web.Request) -> None:
    """Waits until the router drops the connection (recorded in `pod.gone`) or the test
    sets `pod.free`."""
    try:
        while not pod.free.is_set():
            if request.transport is None or request.transport.is_closing():
                pod.gone.append(request.path)
                return
            await asyncio.sleep(0.01)
    except asyncio.CancelledError:  # the server cancels the handler of a dropped request
        pod.gone.append(request.path)
        raise


async def eventually(check, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert check()


def cluster(min_prefill_tokens: int = 0, prefill_timeout_s: float = 0.3):
    prefill, decode = FakePod("prefill", prefill_pod), FakePod("decode", decode_pod)
    for pod in (prefill, decode):
        pod.mode, pod.free, pod.gone = "ok", asyncio.Event(), []
    return prefill, decode, dict(disagg=DisaggSettings(min_prefill_tokens=min_prefill_tokens,
                                                       prefill_timeout_s=prefill_timeout_s))


def decode_call(decode: FakePod) -> GenerateRequest:
    return GenerateRequest.model_validate_json(decode.bodies[-1])


def test_remote_prefill_hands_its_kv_to_the_decode_pod():
    async def main():
        prefill, decode, settings = cluster()
        router, pods = await start(prefill, decode, **settings)
        status, _, _ = await post(router, chat(max_tokens=5), **{"X-Request-Id": "r1"})
        assert status == 200
        asked = PrefillRequest.model_validate_json(prefill.bodies[0])
        assert asked.api == "chat" and asked.request.max_tokens == 5
        assert prefill.headers[0]["X-Request-Id"] == "r1-prefill"
        call = decode_call(decode)
        assert decode.headers[0]["X-Request-Id"] == "r1"
        assert call.kv_transfer_params == ANSWER.kv_transfer_params
        assert call.prompt_token_ids == ANSWER.prompt_token_ids
        assert not call.return_token_ids and call.resume is None  # not a stream
        assert metric(router, "baton:disagg_decisions_total", decision="remote") == 1
        await stop(router, pods)
    asyncio.run(main())


def test_every_prefill_failure_falls_back_to_a_local_prefill():
    async def main():
        prefill, decode, settings = cluster()
        router, pods = await start(prefill, decode, **settings)
        # A malformed answer opens the pod's circuit at once: it comes last.
        for mode, reason in [("error", "prefill_error"), ("slow", "prefill_failed"),
                             ("garbage", "prefill_failed")]:
            prefill.mode = mode
            t0 = time.monotonic()
            status, _, _ = await post(router, chat(stream=True))
            assert status == 200, mode
            call = decode_call(decode)
            assert call.kv_transfer_params is None and call.prompt_token_ids is None, mode
            assert call.return_token_ids  # a stream: the decode pod sends token events
            assert metric(router, "baton:fallbacks_total", reason=reason) >= 1, mode
            assert time.monotonic() - t0 < 0.9, mode  # the prefill timeout, not the pod
        assert metric(router, "baton:fallbacks_total", reason="prefill_failed") == 2
        assert metric(router, "baton:disagg_decisions_total", decision="local") == 3
        ep = router.app[ROUTER].discovery.endpoints[prefill.url]
        assert ep.consecutive_failures == 3 and ep.inflight == 0

        ep.open_until = time.monotonic() + 60  # no prefill pod to take it
        prefill.mode = "ok"
        await post(router, chat())
        assert decode_call(decode).kv_transfer_params is None and len(prefill.bodies) == 3
        assert metric(router, "baton:fallbacks_total", reason="no_prefill_worker") == 1
        await stop(router, pods)
    asyncio.run(main())


def test_a_short_prompt_is_prefilled_on_the_decode_pod():
    async def main():
        prefill, decode, settings = cluster(min_prefill_tokens=256)
        router, pods = await start(prefill, decode, **settings)
        await post(router, chat())
        assert prefill.bodies == [] and decode_call(decode).kv_transfer_params is None
        assert metric(router, "baton:disagg_decisions_total", decision="local") == 1
        assert metric(router, "baton:fallbacks_total", reason="no_prefill_worker") == 0
        await stop(router, pods)
    asyncio.run(main())


def test_a_refusal_the_request_caused_goes_back_to_the_client_without_a_fallback():
    async def main():
        prefill, decode, settings = cluster(prefill_timeout_s=30)
        router, pods = await start(prefill, decode, **settings)
        prefill.mode = "refuse"
        t0 = time.monotonic()
        status, _, body = await post(router, chat())
        assert status == 400 and time.monotonic() - t0 < 1.0
        error = json.loads(body)["error"]
        assert error["message"] == "the prompt is too long"
        assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
        prefill.mode = "engine refused it"
        assert (await post(router, chat()))[0] == 500
        assert decode.bodies == [] and len(prefill.bodies) == 2  # no local prefill
        assert metric(router, "baton:fallbacks_total", reason="prefill_error") == 0
        assert router.app[ROUTER].discovery.endpoints[prefill.url].consecutive_failures == 0
        await stop(router, pods)
    asyncio.run(main())


def test_a_prefill_pod_marked_down_lets_its_waiting_requests_fall_back_at_once():
    async def main():
        prefill, decode, settings = cluster(prefill_timeout_s=30)
        router, pods = await start(prefill, decode, check_interval_s=0.05, **settings)
        prefill.mode = "hang"
        request = asyncio.create_task(post(router, chat()))
        while not prefill.bodies:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        prefill.ready = False  # the next health check marks it down
        status, _, _ = await asyncio.wait_for(request, 5)
        assert status == 200 and time.monotonic() - t0 < 1.0  # not the 30 s timeout
        assert decode_call(decode).kv_transfer_params is None  # prefilled locally
        assert metric(router, "baton:fallbacks_total", reason="prefill_pod_down") == 1
        await eventually(lambda: prefill.gone == ["/internal/prefill"])  # the call dropped
        prefill.free.set()
        await stop(router, pods)
    asyncio.run(main())


async def leave_after(router, seconds: float) -> None:
    """A client that gives up on its request after `seconds`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=seconds)) as s:
        with pytest.raises(TimeoutError):
            await s.post(router.make_url("/v1/chat/completions"), json=chat())


def test_a_client_that_leaves_before_the_decode_pod_took_the_lease_releases_it():
    async def main():
        prefill, decode, settings = cluster()
        router, pods = await start(prefill, decode, **settings)
        assert (await post(router, chat()))[0] == 200 and prefill.released == []  # taken
        decode.mode = "hang"  # the decode pod never answers: the lease is not taken over
        await leave_after(router, 0.3)
        await eventually(lambda: prefill.released == ["lease-1"])
        assert metric(router, "baton:router_kv_releases_total", result="released") == 1
        await eventually(lambda: decode.gone == ["/internal/generate"])

        prefill.mode, decode.mode = "hang", "ok"  # gone while the prefill runs: no lease
        await leave_after(router, 0.2)
        await eventually(lambda: prefill.gone == ["/internal/prefill"])  # call cancelled
        assert prefill.released == ["lease-1"]  # nothing more to release
        decode.free.set()
        prefill.free.set()
        await stop(router, pods)
    asyncio.run(main())
