"""How a worker ends: SIGTERM drains (ready turns 503, new work 503, the streams in flight
finish, then the server stops with exit code 0); a dead engine loop stops it with exit
code 1. A real uvicorn server on loopback over the scripted engine."""

from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import dataclass

import aiohttp
import uvicorn

from baton.common.stats import EngineStats
from baton.worker.app import build_app
from baton.worker.lifecycle import Inflight, WorkerServer
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.worker.fakes import MODEL, FakeEngine, count_to, make_pipeline


@dataclass
class SlowEngine(FakeEngine):
    """Each output batch `delay` seconds after the last."""

    delay: float = 0.1

    def submit(self, req):
        self.submitted.append(req.request_id)
        queue: asyncio.Queue = asyncio.Queue()

        async def feed():
            for batch in self.script(req):
                await asyncio.sleep(self.delay)
                queue.put_nowait(batch)
        asyncio.get_running_loop().create_task(feed())
        return queue

    def stats(self) -> EngineStats:
        return EngineStats()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start(engine: SlowEngine, drain_s: float = 10.0):
    state = WorkerState(WorkerSettings())
    state.pipeline, _, _ = make_pipeline(engine)
    state.engine = engine
    inflight = Inflight(build_app(state.settings, state))
    port = _free_port()
    config = uvicorn.Config(inflight, host="127.0.0.1", port=port, lifespan="off",
                            log_config=None)
    server = WorkerServer(config, state, inflight, drain_s)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return state, server, task, f"http://127.0.0.1:{port}"


BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True}


def test_sigterm_drains_what_is_in_flight_and_refuses_new_work():
    async def main():
        state, server, task, url = await _start(SlowEngine(count_to(10)))
        async with aiohttp.ClientSession() as s:
            async def stream():
                async with s.post(url + "/v1/completions", json=BODY) as r:
                    return r.status, await r.text()

            streaming = asyncio.create_task(stream())
            await asyncio.sleep(0.35)
            assert server.inflight.count == 1
            server.handle_exit(signal.SIGTERM, None)
            await asyncio.sleep(0.05)
            async with s.get(url + "/ready") as r:
                assert (r.status, (await r.json())["status"]) == (503, "draining")
            async with s.post(url + "/v1/completions", json=BODY) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "draining"
            status, text = await streaming
        assert status == 200 and text.count('"text"') == 10 and "[DONE]" in text
        await asyncio.wait_for(task, 10)
        assert state.exit_code == 0 and server.inflight.count == 0

    asyncio.run(main())


def test_a_drain_stops_at_its_timeout():
    async def main():
        _, server, task, url = await _start(SlowEngine(count_to(100), delay=0.2), drain_s=0.5)
        async with aiohttp.ClientSession() as s:
            async def stream():
                async with s.post(url + "/v1/completions", json=BODY | {"max_tokens": 100}) as r:
                    return await r.text()

            streaming = asyncio.create_task(stream())
            await asyncio.sleep(0.3)
            server.handle_exit(signal.SIGTERM, None)
            await asyncio.wait_for(task, 10)  # ~0.5 s of drain + uvicorn's 5 s at most
            streaming.cancel()

    asyncio.run(main())


def test_a_dead_engine_loop_ends_the_process_with_exit_code_1():
    async def main():
        engine = SlowEngine()
        state, server, task, _ = await _start(engine)
        engine.dead_error = RuntimeError("the loop died")
        await asyncio.wait_for(task, 5)
        assert state.exit_code == 1

    asyncio.run(main())
