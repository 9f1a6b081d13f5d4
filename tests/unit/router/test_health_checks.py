"""Static discovery's health checks: whatever one worker answers on /load — garbage, a wrong
shape, JSON nested deep, a huge body, a 404 — marks that worker down and nothing else, and
the checks go on (a later good answer brings it back)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from baton.router.discovery import MAX_LOAD_REPORT_BYTES, StaticDiscovery

GOOD = {"ready": True, "role": "both", "model": "m", "running": 1}
BAD_ANSWERS = [  # each a fresh response per request
    lambda: web.Response(text="<html>not found</html>", status=404),
    lambda: web.Response(text="{not json", content_type="application/json"),
    lambda: web.json_response([1, 2, 3]),
    lambda: web.json_response({"ready": True}),  # not a load report: no role, no model
    lambda: web.Response(text="[" * 100_000 + "]" * 100_000, content_type="application/json"),
    lambda: web.Response(body=b"{" + b" " * (MAX_LOAD_REPORT_BYTES + 10) + b"}",
                         content_type="application/json"),
]


class Worker:
    def __init__(self) -> None:
        self.answer: Callable[[], web.StreamResponse] | dict = GOOD
        app = web.Application()
        app.router.add_get("/load", self._load)
        self.server = TestServer(app)

    async def _load(self, request: web.Request) -> web.StreamResponse:
        if isinstance(self.answer, dict):
            return web.json_response(self.answer)
        return self.answer()

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", range(len(BAD_ANSWERS)))
async def test_a_bad_load_answer_marks_only_that_worker_down(bad):
    good, odd = Worker(), Worker()
    await good.server.start_server()
    await odd.server.start_server()
    odd.answer = BAD_ANSWERS[bad]
    discovery = StaticDiscovery([good.url, odd.url], check_interval_s=0.05)
    async with aiohttp.ClientSession() as session:
        await discovery.start(session)
        try:
            await discovery.wait_first_round(5)
            await asyncio.sleep(0.2)  # a few more rounds
            by_url = {ep.url: ep for ep in discovery.all()}
            assert by_url[good.url].healthy and by_url[good.url].running == 1
            assert not by_url[odd.url].healthy
            odd.answer = GOOD  # the checks went on: it comes back
            for _ in range(100):
                if by_url[odd.url].healthy:
                    break
                await asyncio.sleep(0.05)
            assert by_url[odd.url].healthy
        finally:
            await discovery.stop()
            await good.server.close()
            await odd.server.close()
