"""/v1/responses through a real router in front of fake workers: the workers get chat, the
client gets a Response; stored responses (GET, DELETE, 404, previous_response_id); and a
Responses stream whose decode pod dies mid-stream, resumed on another as one stream."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from baton.common.internal import GenerateRequest
from baton.router.app import ROUTER
from tests.unit.router.fakes import HEADER, FakePod, content, start, stop, stream, tokens

CHAT_ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
               "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
               "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                            "message": {"role": "assistant", "content": "Paris."}}]}


async def call(router: TestServer, method: str, path: str, body: dict | None = None
               ) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, router.make_url(path), json=body) as resp:
            return resp.status, await resp.text()


def test_a_response_is_served_as_chat_stored_and_continued():
    async def chat(pod: FakePod, request: web.Request, body: bytes):
        assert request.path == "/v1/chat/completions"
        return web.json_response(CHAT_ANSWER)

    async def main():
        router, pods = await start(FakePod("both", chat))
        status, text = await call(router, "POST", "/v1/responses", {
            "model": "m", "input": "Capital of France?", "instructions": "Be brief.",
            "max_output_tokens": 8, "metadata": {"k": "v"}})
        assert status == 200, text
        first = json.loads(text)
        assert first["object"] == "response" and first["status"] == "completed"
        assert first["output"][0]["content"][0]["text"] == "Paris."
        assert first["usage"]["input_tokens"] == 5 and first["metadata"] == {"k": "v"}
        sent = json.loads(pods[0].bodies[0])
        assert sent["max_completion_tokens"] == 8 and sent["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France?"}]

        status, text = await call(router, "GET", f"/v1/responses/{first['id']}")
        assert status == 200 and json.loads(text) == first

        status, text = await call(router, "POST", "/v1/responses", {
            "model": "m", "input": "And Italy?", "previous_response_id": first["id"]})
        assert status == 200 and json.loads(text)["previous_response_id"] == first["id"]
        assert json.loads(pods[0].bodies[1])["messages"] == [  # instructions not carried
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Italy?"}]

        status, text = await call(router, "DELETE", f"/v1/responses/{first['id']}")
        assert status == 200 and json.loads(text)["deleted"] is True
        for method, path, body in [
                ("GET", f"/v1/responses/{first['id']}", None),
                ("DELETE", f"/v1/responses/{first['id']}", None),
                ("POST", "/v1/responses", {"model": "m", "input": "x",
                                           "previous_response_id": first["id"]})]:
            status, text = await call(router, method, path, body)
            error = json.loads(text)["error"]
            assert status == 404 and error["code"] == "response_not_found", text
            assert error["type"] == "not_found_error"
        assert len(pods[0].bodies) == 2  # the unknown previous_response_id never left
        status, text = await call(router, "POST", "/v1/responses",
                                  {"model": "m", "input": "x", "background": True})
        assert status == 400 and json.loads(text)["error"]["param"] == "background"
        await stop(router, pods)
    asyncio.run(main())


def test_a_worker_s_error_answer_passes_through_unstored():
    async def refuse(pod: FakePod, request: web.Request, body: bytes):
        return web.json_response({"error": {"message": "bad", "type": "invalid_request_error",
                                            "param": "messages", "code": None}}, status=400)

    async def main():
        router, pods = await start(FakePod("both", refuse))
        status, text = await call(router, "POST", "/v1/responses", {"model": "m", "input": "x"})
        assert status == 400 and json.loads(text)["error"]["message"] == "bad"
        assert len(router.app[ROUTER].responses_api.store) == 0
        await stop(router, pods)
    asyncio.run(main())


def test_a_responses_stream_survives_its_decode_pod():
    async def dies_unless_resumed(pod: FakePod, request: web.Request, body: bytes):
        generate = GenerateRequest.model_validate_json(body)
        assert generate.api == "chat"  # the decode pod gets chat
        if generate.resume is None:
            return await stream(request, tokens(prompt_token_ids=[1, 2, 3], header=HEADER),
                                content("", role="assistant"), tokens([5], 3),
                                content("Hel"), tokens([6], 2), die=True)
        return await stream(request, tokens(prompt_token_ids=[1, 2, 3, 5], header=HEADER),
                            tokens([6], 2), content("lo"), tokens([7], finished=True),
                            content("", "stop"),
                            b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk",'
                            b'"created":7,"model":"m","choices":[],"usage":{"prompt_tokens":3,'
                            b'"completion_tokens":3,"total_tokens":6}}\n\n', b"data: [DONE]\n\n")

    async def main():
        router, pods = await start(FakePod("decode", dies_unless_resumed),
                                   FakePod("decode", dies_unless_resumed))
        status, text = await call(router, "POST", "/v1/responses",
                                  {"model": "m", "input": "hi", "stream": True})
        assert status == 200
        events = [json.loads(block.split("\n")[1][6:]) for block in text.split("\n\n")
                  if block]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "baton.tokens" not in text and "[DONE]" not in text
        assert "".join(e["delta"] for e in events
                       if e["type"] == "response.output_text.delta") == "Hello"
        final = events[-1]
        assert final["type"] == "response.completed"
        assert final["response"]["usage"]["output_tokens"] == 3
        status, text = await call(router, "GET", f"/v1/responses/{final['response']['id']}")
        assert status == 200 and json.loads(text)["output"][0]["content"][0]["text"] == "Hello"
        await stop(router, pods)
    asyncio.run(main())


def test_a_responses_stream_that_breaks_for_good_ends_with_response_failed():
    async def dies(pod: FakePod, request: web.Request, body: bytes):
        return await stream(request, tokens(prompt_token_ids=[1], header=HEADER),
                            content("", role="assistant"), tokens([5], 1), content("a"),
                            die=True)

    async def main():
        router, pods = await start(FakePod("decode", dies))
        status, text = await call(router, "POST", "/v1/responses",
                                  {"model": "m", "input": "hi", "stream": True})
        types = [json.loads(b.split("\n")[1][6:])["type"] for b in text.split("\n\n") if b]
        assert status == 200 and types[-2:] == ["error", "response.failed"]
        assert "upstream_failed" in text
        await stop(router, pods)
    asyncio.run(main())
