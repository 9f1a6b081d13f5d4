"""LoRA adapters at the router: workers report the adapters they serve and the ones they hold
loaded; the router lists them (with their base as parent), routes a request naming one only
to workers serving it, prefers those holding it loaded, and spills over to the others when
those are busy."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from baton.common.hashing import ROOT_HASH, hash_token_blocks, lora_root_hash
from baton.common.protocol import CompletionRequest, parse_request
from baton.common.registry import LoadReport, hash_hex
from baton.router.discovery import StaticDiscovery, Upstream, update
from baton.router.prefix import BlockIndex
from baton.router.routing_context import ContextBuilder
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.pipeline import RoutingPipeline
from tests.unit.router.fakes import FakePod, chat, content, post, start, stop, stream


class LoRAPod(FakePod):
    def __init__(self, adapters: list[str], loaded: list[str]) -> None:
        super().__init__("both", answer)
        self.adapters, self.loaded = adapters, loaded

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response({
            "ready": True, "role": "both", "model": "base", "running": 0, "waiting": 0,
            "kv_blocks_used": 0, "kv_blocks_total": 10, "lora_adapters": self.adapters,
            "lora_loaded": self.loaded})


async def answer(pod, request, body):
    return await stream(request, content("hi", "stop"))


def test_adapters_are_listed_and_routed_to_the_workers_serving_them():
    async def main():
        a, b = LoRAPod(["sql", "chat"], ["sql"]), LoRAPod(["chat"], ["chat"])
        router, pods = await start(a, b)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(router.make_url("/v1/models")) as resp:
                    cards = {m["id"]: m for m in (await resp.json())["data"]}
            assert sorted(cards) == ["base", "chat", "sql"]
            assert cards["sql"]["parent"] == "base" and "parent" not in cards["base"]
            for _ in range(3):  # only pod a serves it
                code, _, _ = await post(router, chat(model="sql", stream=True))
                assert code == 200 and json.loads(a.bodies[-1])["model"] == "sql"
            assert not b.bodies
            code, _, text = await post(router, chat(model="nope", stream=True))
            assert code == 404 and "'sql'" in text
        finally:
            await stop(router, pods)

    asyncio.run(main())


def pod(url: str, loaded: list[str], running: int = 0) -> Upstream:
    ep = Upstream(url)
    update(ep, LoadReport(role="both", model="base", running=running, kv_blocks_total=10,
                          lora_adapters=["sql"], lora_loaded=loaded))
    return ep


def test_workers_holding_the_adapter_are_preferred_until_they_are_busy():
    pipeline = RoutingPipeline.from_policy("load")
    cold, warm = pod("http://cold", []), pod("http://warm", ["sql"])
    assert pipeline.pick([cold, warm], RoutingContext(model="sql")) is warm
    working = pod("http://working", ["sql"], running=2)
    assert pipeline.pick([cold, working], RoutingContext(model="sql")) is working
    busy = pod("http://busy", ["sql"], running=4)
    assert pipeline.pick([cold, busy], RoutingContext(model="sql")) is cold  # spill-over
    # a base model request: the adapters change nothing
    assert pipeline.pick([busy, cold], RoutingContext(model="base")) is cold


class RootTokenizer:
    block_size = 16

    def prompt_ids(self, api: str, req) -> list[int]:
        return list(range(100, 150))

    def block_hashes(self, ids: list[int], root: int = ROOT_HASH) -> list[str]:
        return [hash_hex(h) for h in hash_token_blocks(ids, self.block_size, root)]


class Tokenizers:
    def get(self, model: str, urls: list[str]) -> RootTokenizer:
        return RootTokenizer()


def test_adapter_prompts_hash_from_the_adapters_root():
    """The exact hashes of an adapter's prompt chain from the root its workers report
    (what the engine hashes, `tests/unit/engine/lora/test_hashes.py`); the estimated ones
    differ from the base model's too."""
    discovery = StaticDiscovery(["http://w"])
    ep = discovery.all()[0]
    root = lora_root_hash("digest")
    update(ep, LoadReport(role="both", model="base", lora_adapters=["sql"],
                          lora_roots={"sql": hash_hex(root)}))
    body = {"model": "sql", "prompt": list(range(100, 150))}
    sql = parse_request(CompletionRequest, json.dumps(body).encode())
    base = parse_request(CompletionRequest, json.dumps(body | {"model": "base"}).encode())
    exact = ContextBuilder(discovery, BlockIndex(), Tokenizers())
    assert list(asyncio.run(exact.build("completions", sql)).prefix_hashes) == [
        hash_hex(h) for h in hash_token_blocks(list(range(100, 150)), 16, root)]
    assert list(asyncio.run(exact.build("completions", base)).prefix_hashes) == [
        hash_hex(h) for h in hash_token_blocks(list(range(100, 150)), 16)]
    estimate = ContextBuilder(discovery, None, Tokenizers())
    a, b = (asyncio.run(estimate.build("completions", r)).prefix_hashes for r in (sql, base))
    assert a and b and not set(a) & set(b)
