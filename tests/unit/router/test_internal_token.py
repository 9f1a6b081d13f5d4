"""Every call the router makes to a worker carries the internal token (`X-Baton-Token`),
and none carries the client's `Authorization`."""

from __future__ import annotations

import asyncio

from aiohttp import web

from baton.common.auth import TOKEN_HEADER
from baton.router.app import ROUTER
from baton.router.scheduling.disagg import DisaggSettings
from tests.unit.router.fakes import FakePod, chat, post, prefill_answer, start, stop

TOKEN = "internal-token-0123456789"
CLIENT_KEY = "sk-client-key"


async def pod_answer(pod: FakePod, request: web.Request, body: bytes):
    if request.path == "/internal/prefill":
        return web.Response(body=prefill_answer([1, 2]).model_dump_json(),
                            content_type="application/json")
    if pod.refuse:  # a final refusal: no decode pod takes the lease, which is released
        return web.json_response({"error": {"message": "no"}}, status=400)
    return web.json_response({"id": "c", "choices": []})


def make(role: str) -> FakePod:
    pod = FakePod(role, pod_answer)
    pod.refuse = False
    return pod


def test_the_token_goes_on_every_call_and_the_clients_key_on_none():
    async def main():
        prefill, decode, both = make("prefill"), make("decode"), make("both")
        router, pods = await start(prefill, decode, internal_token=TOKEN, api_key=CLIENT_KEY,
                                   disagg=DisaggSettings(min_prefill_tokens=0))
        auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert (await post(router, chat(), **auth))[0] == 200
        decode.refuse = True
        assert (await post(router, chat(), **auth))[0] == 400
        for _ in range(50):  # the release is posted in the background
            if prefill.released:
                break
            await asyncio.sleep(0.02)
        assert prefill.released == ["lease-1"]
        tokenizers = router.app[ROUTER].tokenizers
        tokenizers.get("m", [decode.url])
        await asyncio.gather(*tokenizers._fetching.values())
        colocated, others = await start(both, internal_token=TOKEN, api_key=CLIENT_KEY)
        assert (await post(colocated, chat(), **auth))[0] == 200

        calls = [*prefill.headers, *decode.headers, *both.headers, *prefill.release_headers,
                 prefill.get_headers["/load"], decode.get_headers["/load"],
                 decode.get_headers["/internal/tokenizer"], both.get_headers["/load"]]
        assert len(calls) == 10  # 2 prefills, 2 decodes, 1 forward, 1 release, 4 GETs
        assert {h.get(TOKEN_HEADER) for h in calls} == {TOKEN}
        assert not any("Authorization" in h for h in calls)
        assert [h.get("X-Request-Id", "")[-8:] for h in prefill.release_headers] == ["-release"]
        await stop(colocated, others)
        await stop(router, pods)
    asyncio.run(main())


def test_without_a_token_no_header_is_sent():
    async def main():
        router, pods = await start(make("both"))
        assert (await post(router, chat()))[0] == 200
        assert TOKEN_HEADER not in pods[0].headers[0]
        assert TOKEN_HEADER not in pods[0].get_headers["/load"]
        await stop(router, pods)
    asyncio.run(main())
