"""The request-head deadline (`common.http_limits`) against real servers on loopback, with
raw sockets: slowloris connections (a head dribbled a line at a time) are closed after the
deadline, on the router (aiohttp) and on a worker's server (uvicorn + httptools); a
kept-alive connection that idles, and a request body that arrives slowly, are not."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from aiohttp import web

from baton.router.app import ROUTER, listen
from baton.router.settings import RouterSettings
from benchmarks.procs import free_port_run
from tests.integration.conftest import http_get, wait_for
from tests.unit.router.fakes import FakePod

DEADLINE_S = 0.5
SLOWLORIS = 40


async def slowloris(port: int, path: str, give_up_s: float = 5.0) -> float | None:
    """Seconds until the server closed a connection whose head never ends (one header
    line every 0.1 s), or None if it was still open after `give_up_s`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode())
    try:
        while time.monotonic() - t0 < give_up_s:
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1024), 0.1) == b"":
                    return time.monotonic() - t0
            except TimeoutError:
                writer.write(b"X-Slow: still-coming\r\n")
        return None
    except (ConnectionError, OSError):
        return time.monotonic() - t0
    finally:
        writer.close()


async def request(reader, writer, head: str, body: bytes = b"",
                  pause_s: float = 0.0) -> bytes:
    """Send a request (its body in 4 parts, `pause_s` apart) and read one response head."""
    writer.write(head.encode())
    for i in range(4):
        await asyncio.sleep(pause_s)
        writer.write(body[i * len(body) // 4:(i + 1) * len(body) // 4])
    await writer.drain()
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)


async def well_behaved(port: int, post_path: str) -> tuple[bytes, bytes]:
    """A kept-alive connection idle past the deadline between two requests, then a POST
    whose body takes 2x the deadline: the response heads of both requests."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    get = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    assert b" 200 " in await request(reader, writer, get)
    await reader.read(1024)  # the small body
    await asyncio.sleep(DEADLINE_S * 2)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    head = (f"POST {post_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    answer = await request(reader, writer, head, body, pause_s=DEADLINE_S / 2)
    writer.close()
    return answer, b""


def test_the_router_closes_slowloris_connections_and_keeps_good_ones():
    async def answer(pod: FakePod, request: web.Request, body: bytes):
        return web.json_response({"id": "c", "choices": []})

    async def main():
        pod = FakePod("both", answer)
        await pod.server.start_server()
        settings = RouterSettings(workers=(pod.url,), header_timeout_s=DEADLINE_S)
        runner, server = await listen(settings, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        lasted = await asyncio.gather(*(slowloris(port, "/health")
                                        for _ in range(SLOWLORIS)))
        answer_head, _ = await well_behaved(port, "/v1/chat/completions")
        timeouts = runner.app[ROUTER].metrics.registry.get_sample_value(
            "baton:router_header_timeouts_total")
        server.close()
        await runner.cleanup()
        await pod.server.close()
        return lasted, answer_head, timeouts

    lasted, answer_head, timeouts = asyncio.run(main())
    assert all(t is not None and DEADLINE_S * 0.9 <= t < DEADLINE_S + 1.0 for t in lasted), \
        lasted
    assert timeouts == SLOWLORIS
    assert b" 200 " in answer_head  # the slow body was not cut, the idle connection kept


WORKER = """
import sys, uvicorn
from baton.common.http_limits import httptools_protocol

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            http=httptools_protocol(float(sys.argv[2])), loop="uvloop", log_config=None)
"""


def test_a_workers_uvicorn_closes_slowloris_connections_and_keeps_good_ones():
    port = free_port_run(1)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(port), str(DEADLINE_S)])
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/health", 1)[0] == 200, 30,
                 "the uvicorn server")

        async def main():
            lasted = await asyncio.gather(*(slowloris(port, "/health")
                                            for _ in range(SLOWLORIS)))
            return lasted, (await well_behaved(port, "/echo"))[0]

        lasted, answer_head = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(10)
    assert all(t is not None and DEADLINE_S * 0.9 <= t < DEADLINE_S + 1.0 for t in lasted), \
        lasted
    assert b" 200 " in answer_head
