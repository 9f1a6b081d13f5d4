"""The router against a worker that fails: retries go to a healthy worker before any byte
reaches the client, the failing one is counted and its circuit opens."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from tests.integration.conftest import MODEL, Proc, free_port_run, http_get, metric_value, post_json
from tests.unit.router.fakes import identify

pytestmark = pytest.mark.slow


class BrokenWorker:
    """Reports itself ready on /load, then fails every generation request: half with a 500,
    half by dropping the connection (a stand-in for a worker crashing under a request)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.calls = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def load(self, _request):
        return web.json_response({"role": "both", "model": MODEL, "ready": True, "running": 0,
                                  "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 10,
                                  "max_waiting": 10, "max_model_len": 8192})

    async def generate(self, request):
        self.calls += 1
        await request.read()
        if self.calls % 2:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        request.transport.close()
        return web.Response()

    def start(self) -> None:
        app = web.Application()
        app.on_response_prepare.append(identify)
        app.router.add_get("/load", self.load)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.runner = web.AppRunner(app)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_retry_on_another_worker(cluster, tmp_path):
    port = free_port_run(2)
    broken = BrokenWorker(port + 1)
    broken.start()
    bad = f"http://127.0.0.1:{port + 1}"
    router = Proc(["router", "--port", str(port), "--workers",
                   f"{bad},{cluster.workers[0]}", "--policy", "round_robin",
                   "--check-interval", "0.2"], tmp_path / "router.log").start()
    url = f"http://127.0.0.1:{port}"
    try:
        router.wait_ready(url, timeout=30)
        for stream in (False, True, False, True, False, True):
            code, _, answer = post_json(url + "/v1/completions", {
                "model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": stream})
            assert code == 200, answer
            if stream:
                assert answer.endswith("data: [DONE]\n\n") and '"error"' not in answer
        assert broken.calls >= 3
        assert metric_value(url, "baton:router_retries_total") >= 3
        errors = metric_value(url, f'baton:router_upstream_errors_total{{reason="status 500",'
                                   f'upstream="{bad}"}}')
        assert errors >= 1
        _, workers = http_get(url + "/workers")
        state = {w["url"]: w for w in json.loads(workers)["workers"]}
        assert state[bad]["circuit_open"]  # 3 consecutive failures opened it
        assert not state[cluster.workers[0]]["circuit_open"]
    finally:
        assert router.stop()
        broken.stop()


def test_router_without_workers_answers_503(tmp_path):
    port = free_port_run(2)
    url = f"http://127.0.0.1:{port}"
    router = Proc(["router", "--port", str(port), "--workers", f"http://127.0.0.1:{port + 1}"],
                  tmp_path / "router.log").start()
    try:
        from tests.integration.conftest import wait_for

        wait_for(lambda: http_get(url + "/health")[0] == 200, 30, "router up")
        assert http_get(url + "/ready")[0] == 503
        code, headers, answer = post_json(url + "/v1/completions",
                                          {"model": MODEL, "prompt": "x"})
        assert code == 503 and answer["error"]["type"] == "service_unavailable_error"
        assert headers["Retry-After"] == "1"
    finally:
        assert router.stop()
