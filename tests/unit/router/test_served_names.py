"""Workers serving a model under several names (`--served-model-name a b`): the router
lists every name, routes a request for any of them to those workers, and still reads the
one-name reports (and registry records) of older workers."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from baton.common.registry import WorkerRecord
from baton.router.discovery import Upstream, update
from tests.unit.router.fakes import FakePod, chat, content, post, start, stop, stream


class NamedPod(FakePod):
    """A worker whose /load names its models as a current worker does (or, with
    `models=None`, as an older one: `model` alone)."""

    def __init__(self, model: str, models: list[str] | None) -> None:
        super().__init__("both", answer)
        self.model, self.models = model, models

    async def _load(self, request: web.Request) -> web.Response:
        report = {"ready": True, "role": "both", "model": self.model, "running": 0,
                  "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 10}
        return web.json_response(report | ({"models": self.models} if self.models else {}))


async def answer(pod, request, body):
    return await stream(request, content("hi", "stop"))


def test_any_served_name_routes_to_its_workers():
    async def main():
        a, b = NamedPod("a", ["a", "a-alias"]), NamedPod("b", None)
        router, pods = await start(a, b)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(router.make_url("/v1/models")) as resp:
                    listed = [m["id"] for m in (await resp.json())["data"]]
            assert sorted(listed) == ["a", "a-alias", "b"]
            for name, pod in (("a-alias", a), ("a", a), ("b", b)):
                before = len(pod.bodies)
                code, _, _ = await post(router, chat(model=name, stream=True))
                assert code == 200 and len(pod.bodies) == before + 1
                assert json.loads(pod.bodies[-1])["model"] == name  # passed on as asked
            code, _, text = await post(router, chat(model="nope", stream=True))
            assert code == 404 and "['a', 'a-alias', 'b']" in text
        finally:
            await stop(router, pods)

    asyncio.run(main())


def test_a_registry_record_carries_the_names_and_older_ones_still_read():
    record = WorkerRecord(id="w1", url="http://w1", role="both", model="a",
                          models=["a", "a-alias"])
    ep = Upstream("http://w1")
    update(ep, WorkerRecord.model_validate_json(record.model_dump_json()))
    assert ep.names == ("a", "a-alias") and ep.serves("a-alias") and not ep.serves("b")
    old = WorkerRecord.model_validate({"id": "w2", "url": "http://w2", "role": "both",
                                       "model": "b"})  # a worker from before the names
    ep2 = Upstream("http://w2")
    update(ep2, old)
    assert ep2.names == ("b",) and ep2.serves("b")
    assert Upstream("http://fresh").names == ()  # nothing reported yet: serves nothing
