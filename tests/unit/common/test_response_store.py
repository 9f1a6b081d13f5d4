"""Stored responses: the conversation a next turn continues, the in-process store's bounds,
and the Redis store (a real valkey-server) shared by two routers' stores, with its TTL."""

from __future__ import annotations

import asyncio
import json

import pytest

from baton.common import registry as reg
from baton.common.errors import OpenAIError
from baton.common.protocol import parse_request
from baton.common.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    StoredResponse,
)
from baton.common.responses_api import ResponsesRequest
from baton.common.responses_turn import Turn


def answered(text: str = "Paris.", **body) -> Turn:
    """A turn whose chat answer came back whole."""
    turn = Turn(parse_request(ResponsesRequest, json.dumps(
        {"model": "m", "input": "Capital of France?"} | body).encode()), [], None, b"")
    turn.format.whole(json.dumps({
        "id": "c", "object": "chat.completion", "created": 1, "model": "m",
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None, "message": {
            "role": "assistant", "content": text, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]}}]}).encode())
    return turn


def test_a_turn_keeps_its_input_and_output_for_the_next():
    async def main():
        store = MemoryResponseStore()
        first = answered()
        await first.keep(store)
        rid = first.format.response.id
        nxt = await Turn.start(json.dumps({"model": "m", "input": "And Italy?",
                                           "previous_response_id": rid}).encode(), store)
        messages = nxt.chat.template_messages()
        assert [(m["role"], m["content"]) for m in messages] == [
            ("user", "Capital of France?"), ("assistant", "Paris."), ("user", "And Italy?")]
        assert messages[1]["tool_calls"][0]["id"] == "call_1"
        with pytest.raises(OpenAIError) as err:
            await Turn.start(json.dumps({"model": "m", "input": "x",
                                         "previous_response_id": "resp_nope"}).encode(), store)
        assert (err.value.status, err.value.param, err.value.code) == (
            404, "previous_response_id", "response_not_found")
        unstored = answered(store=False)
        await unstored.keep(store)
        assert await store.get(unstored.format.response.id) is None
    asyncio.run(main())


def test_the_memory_store_drops_the_least_recently_used():
    async def main():
        store = MemoryResponseStore(max_entries=2)
        turns = [answered(f"answer {i}") for i in range(3)]
        await turns[0].keep(store)
        await turns[1].keep(store)
        assert await store.get(turns[0].format.response.id) is not None  # now most recent
        await turns[2].keep(store)
        ids = [t.format.response.id for t in turns]
        assert [await store.get(i) is not None for i in ids] == [True, False, True]
        assert await store.delete(ids[0]) and not await store.delete(ids[0])
        assert len(store) == 1
        small = MemoryResponseStore(max_bytes=len(StoredResponse(
            response=turns[0].format.response, input=[]).to_json()) * 3 // 2)
        for t in turns:
            await t.keep(small)
        assert len(small) == 1
    asyncio.run(main())
    with pytest.raises(ValueError, match="max_entries=0"):
        MemoryResponseStore(max_entries=0)


def test_two_redis_stores_share_responses_with_a_ttl(redis_server):
    async def main():
        a = RedisResponseStore(reg.redis_client(redis_server.url), "t", ttl_s=60)
        b = RedisResponseStore(reg.redis_client(redis_server.url), "t", ttl_s=60)
        turn = answered()
        await turn.keep(a)
        rid = turn.format.response.id
        found = await b.get(rid)  # another router replica reads it
        assert found is not None and found.response.output_text == "Paris."
        assert 0 < await b.client.ttl(reg.Keys("t").response(rid)) <= 60
        assert await b.delete(rid) and await a.get(rid) is None
        await a.close()
        await b.close()
    asyncio.run(main())


def test_redis_away_is_a_503():
    async def main():
        store = RedisResponseStore(reg.redis_client("redis://127.0.0.1:1/0", 0.5))
        with pytest.raises(OpenAIError) as err:
            await store.get("resp_1")
        assert err.value.status == 503 and err.value.code == "store_unavailable"
        await store.close()
    asyncio.run(main())

