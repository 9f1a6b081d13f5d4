"""Disaggregated requests through a real router in front of a fake prefill pod and a fake
decode pod: the typed bodies each gets, and every fallback to a local prefill."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from baton.common.internal import GenerateRequest, PrefillRequest
from baton.router.app import ROUTER
from baton.router.scheduling.disagg import DisaggSettings
from tests.unit.router.fakes import FakePod, chat, metric, post, prefill_answer, start, stop

ANSWER = prefill_answer([1, 2, 3, 4])


async def prefill_pod(pod: FakePod, request: web.Request, body: bytes):
    mode = pod.mode
    if mode == "slow":
        await asyncio.sleep(1.0)
    if mode == "error":
        return web.json_response({"error": "boom"}, status=500)
    if mode == "garbage":
        return web.json_response({"prompt_token_ids": "nope"})
    return web.Response(body=ANSWER.model_dump_json(), content_type="application/json")


async def decode_pod(pod: FakePod, request: web.Request, body: bytes):
    return web.json_response({"id": "chatcmpl-1", "choices": []})


def cluster(min_prefill_tokens: int = 0):
    prefill, decode = FakePod("prefill", prefill_pod), FakePod("decode", decode_pod)
    prefill.mode = "ok"
    return prefill, decode, dict(disagg=DisaggSettings(min_prefill_tokens=min_prefill_tokens,
                                                       prefill_timeout_s=0.3))


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
        for mode, reason in [("error", "prefill_error"), ("garbage", "prefill_failed"),
                             ("slow", "prefill_failed")]:
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
