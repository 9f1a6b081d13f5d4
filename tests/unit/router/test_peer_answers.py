"""A server that is not a Baton worker, named as one (a stale registry record, a wrong
`--workers` URL): its answers are never relayed as the request's result or fault; its
circuit opens and the request goes to a real worker, or is prefilled locally."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from baton.common.internal import WORKER_HEADER, worker_header
from baton.router.answers import identity_problem
from baton.router.app import ROUTER
from tests.unit.router.fakes import FakePod, chat, content, metric, post, start, stop, stream
from tests.unit.router.test_remote_prefill import cluster, decode_call


async def worker(pod: FakePod, request: web.Request, body: bytes):
    if json.loads(body).get("stream"):
        return await stream(request, content("hi", "stop"), b"data: [DONE]\n\n")
    return web.json_response({"id": "c", "object": "chat.completion", "choices": []})


IMPOSTERS = {
    "a 404 page": lambda: web.Response(text="<html>Not Found</html>", status=404,
                                       content_type="text/html"),
    "a 404 of another API": lambda: web.json_response({"detail": "Not Found"}, status=404),
    "a 200 without choices": lambda: web.json_response({"hello": "world"}),
    "a 200 that is not JSON": lambda: web.Response(text="OK"),
}


@pytest.mark.parametrize("answer", IMPOSTERS)
@pytest.mark.parametrize("streamed", [False, True])
def test_an_imposter_is_never_believed_and_its_requests_go_to_a_worker(answer, streamed):
    async def imposter(pod: FakePod, request: web.Request, body: bytes):
        return IMPOSTERS[answer]()

    async def main():
        router, pods = await start(FakePod("both", imposter), FakePod("both", worker))
        for _ in range(4):
            status, _, body = await post(router, chat(stream=streamed))
            assert status == 200, body
            assert ("data: [DONE]" in body) if streamed else "choices" in json.loads(body)
        bad = router.app[ROUTER].discovery.endpoints[pods[0].url]
        assert bad.circuit_open() and len(pods[0].bodies) == 1  # tried once, then left out
        await stop(router, pods)
    asyncio.run(main())


@pytest.mark.parametrize("identity", ["", "2/abc", "v1"])
@pytest.mark.parametrize("streamed", [False, True])
def test_a_well_formed_answer_from_no_baton_worker_is_not_believed(identity, streamed):
    """The right shape is not enough: an answer must name a Baton worker of the router's
    wire version (X-Baton-Worker), else it is not relayed and the pod is left out."""

    async def main():
        router, pods = await start(FakePod("both", worker, identity=identity),
                                   FakePod("both", worker))
        for _ in range(3):
            status, _, body = await post(router, chat(stream=streamed))
            assert status == 200, body
        assert router.app[ROUTER].discovery.endpoints[pods[0].url].circuit_open()
        assert len(pods[0].bodies) == 1 and len(pods[1].bodies) == 3
        await stop(router, pods)
    asyncio.run(main())


def test_identity_problems():
    assert identity_problem({WORKER_HEADER: worker_header("w1")}, None) is None
    assert identity_problem({WORKER_HEADER: worker_header("w1")}, "w1") is None
    assert "stale record" in identity_problem({WORKER_HEADER: worker_header("w2")}, "w1")
    assert "not a Baton worker" in identity_problem({}, None)
    assert "wire version" in identity_problem({WORKER_HEADER: "9/w1"}, "w1")


def test_a_stream_of_something_else_is_not_relayed():
    async def json_stream(pod: FakePod, request: web.Request, body: bytes):
        return await stream(request, b'{"not": "sse"}')  # text/event-stream, not SSE

    async def main():
        router, pods = await start(FakePod("both", json_stream), FakePod("both", worker))
        for _ in range(3):
            status, _, body = await post(router, chat(stream=True))
            assert status == 200 and '"not"' not in body and "data: [DONE]" in body
        assert router.app[ROUTER].discovery.endpoints[pods[0].url].circuit_open()
        await stop(router, pods)
    asyncio.run(main())


def test_a_prefill_pod_that_is_not_a_baton_worker_falls_back_to_a_local_prefill():
    async def not_found(pod: FakePod, request: web.Request, body: bytes):
        return web.Response(text="404 page not found", status=404)

    async def main():
        _, decode, settings = cluster()
        router, pods = await start(FakePod("prefill", not_found), decode, **settings)
        status, _, _ = await post(router, chat())
        assert status == 200  # not the imposter's 404
        assert decode_call(decode).kv_transfer_params is None  # prefilled on decode
        assert metric(router, "baton:fallbacks_total", reason="prefill_failed") == 1
        assert router.app[ROUTER].discovery.endpoints[pods[0].url].circuit_open()
        await stop(router, pods)
    asyncio.run(main())
