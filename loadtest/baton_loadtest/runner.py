"""Drive a plan against an endpoint: open loop (each request at its arrival time, whatever
the server's state), session turns (after the previous turn plus think time), or closed
loop (C clients, each sending its next request when the previous one ends)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from baton_loadtest.client import ClientSettings, OpenAIStreamClient, RequestRecord
from baton_loadtest.generator import PlannedRequest, RequestFactory
from baton_loadtest.spec import WorkloadSpec


async def run_plan(spec: WorkloadSpec, reqs: list[PlannedRequest], factory: RequestFactory,
                   settings: ClientSettings, progress: bool = True
                   ) -> tuple[list[RequestRecord], float]:
    """Returns the records (in request order) and the run's wall time in seconds."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    total = len(reqs) if reqs else None
    bar = _bar(total, progress)
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        client = OpenAIStreamClient(settings, session)
        t0 = time.perf_counter()

        async def send(req: PlannedRequest) -> RequestRecord:
            rec = await client.send(req, t0)
            records.append(rec)
            if bar is not None:
                bar.update(1)
            return rec

        if spec.arrival.process == "closed":
            await _closed(spec, reqs, factory, send, t0)
        else:
            await _open(reqs, send, t0)
        wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    records.sort(key=lambda r: r.index)
    return records, wall


async def _open(reqs: list[PlannedRequest], send, t0: float) -> None:
    loop = asyncio.get_running_loop()
    base = loop.time() - (time.perf_counter() - t0)
    ended: dict[int, asyncio.Future] = {r.index: loop.create_future() for r in reqs}

    async def one(req: PlannedRequest) -> None:
        if req.after is not None:
            await ended[req.after]
            await asyncio.sleep(req.think_time_s)
        else:
            await asyncio.sleep(max(0.0, base + req.arrival_s - loop.time()))
        try:
            await send(req)
        finally:
            ended[req.index].set_result(None)

    await asyncio.gather(*(one(r) for r in reqs))


async def _closed(spec: WorkloadSpec, reqs: list[PlannedRequest], factory: RequestFactory,
                  send, t0: float) -> None:
    deadline = None if spec.duration_s is None else t0 + spec.duration_s
    counter = iter(range(10 ** 12))

    async def client() -> None:
        for i in counter:
            if reqs:
                if i >= len(reqs):
                    return
                req = reqs[i]
            else:
                if time.perf_counter() >= deadline:
                    return
                req = factory.request(i)
            await send(req)

    await asyncio.gather(*(client() for _ in range(spec.arrival.concurrency)))


def _bar(total: int | None, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", leave=False)
