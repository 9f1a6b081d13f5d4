"""A rolling replacement under load: a decode pod is replaced (a new one registers, the old
one gets SIGTERM) while clients stream without pause, through a router following a Redis
registry. The old pod drains: it leaves the registry at once, answers /ready 503, finishes
its streams and exits 0; no request fails or is cut short."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.integration.conftest import MODEL, Proc, free_port_run, http_get, wait_for

pytestmark = pytest.mark.slow
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1"]
LONG = "Describe a lighthouse at night. " * 8


def _registered(router: str) -> set[str]:
    code, raw = http_get(router + "/workers")
    return {w["url"] for w in json.loads(raw)["workers"] if w["healthy"]} if code == 200 \
        else set()


async def _client(session, router: str, stop: asyncio.Event, results: list) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        payload = {"model": MODEL, "stream": True, "max_tokens": 24, "temperature": 0,
                   "messages": [{"role": "user", "content": (LONG if i % 2 else "") + str(i)}]}
        async with session.post(router + "/v1/chat/completions", json=payload) as r:
            text = (await r.read()).decode()
        finishes = text.count('"finish_reason":"length"') + text.count(
            '"finish_reason":"stop"')
        results.append((r.status, finishes == 1 and "[DONE]" in text
                        and '"error"' not in text, text[-300:]))


def test_replacing_a_decode_pod_under_load_loses_nothing(redis_server, tmp_path):
    port = free_port_run(4)
    url = {n: f"http://127.0.0.1:{port + i}" for i, n in
           enumerate(("router", "prefill", "decode-a", "decode-b"))}
    reg = ["--registry", redis_server.url]

    def worker(name: str, role: str, i: int) -> Proc:
        return Proc(["serve", "--port", str(port + i), "--role", role, *reg,
                     "--drain-timeout", "30", *FLAGS], tmp_path / f"{name}.log")

    procs = {"prefill": worker("prefill", "prefill", 1).start(),
             "decode-a": worker("decode-a", "decode", 2).start()}
    router = Proc(["router", "--port", str(port), *reg, "--disagg-min-prefill-tokens", "32"],
                  tmp_path / "router.log").start()
    try:
        for name, p in procs.items():
            p.wait_ready(url[name])
        router.wait_ready(url["router"])
        wait_for(lambda: {url["prefill"], url["decode-a"]} <= _registered(url["router"]),
                 30, "both pods in the registry")
        results: list = []

        async def run() -> None:
            stop = asyncio.Event()
            async with aiohttp.ClientSession() as s:
                clients = [asyncio.create_task(_client(s, url["router"], stop, results))
                           for _ in range(4)]
                await asyncio.sleep(3)
                procs["decode-b"] = worker("decode-b", "decode", 3).start()
                await asyncio.to_thread(procs["decode-b"].wait_ready, url["decode-b"])
                await asyncio.to_thread(wait_for, lambda: url["decode-b"] in _registered(
                    url["router"]), 30, "decode-b in the registry")
                old = procs["decode-a"].proc
                old.terminate()  # SIGTERM: drain
                t0 = time.monotonic()
                await asyncio.to_thread(wait_for, lambda: url["decode-a"] not in _registered(
                    url["router"]), 5, "decode-a to leave the registry")
                assert time.monotonic() - t0 < 3
                rc = await asyncio.to_thread(old.wait, 60)
                assert rc == 0, procs["decode-a"].log_path.read_text()[-2000:]
                await asyncio.sleep(2)
                stop.set()
                await asyncio.gather(*clients)

        asyncio.run(run())
        assert len(results) >= 8
        bad = [r for r in results if r[0] != 200 or not r[1]]
        assert not bad, bad[:3]
        assert "drained in" in procs["decode-a"].log_path.read_text()
    finally:
        for p in (router, *procs.values()):
            if p.proc.poll() is None:
                p.stop()
