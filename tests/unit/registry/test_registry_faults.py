"""The router's registry view against a misbehaving registry (a real valkey-server): Redis
restarted empty before the workers registered again, and a flood of garbage on the events
channel."""

from __future__ import annotations

import asyncio
import json
import logging

from baton.common import registry as reg
from baton.router.redis_discovery import RegistryDiscovery
from tests.unit.registry.test_registry import report, until

URL = "http://10.0.0.9:8001"


async def publish_heartbeat(redis_url: str, worker_id: str, ttl_s: float) -> None:
    """What a worker's Registration does each interval: its key, and the event."""
    record = reg.WorkerRecord(id=worker_id, url=URL, ttl_s=ttl_s, **report())
    client = reg.redis_client(redis_url)
    keys = reg.Keys()
    await client.set(keys.worker(worker_id), record.model_dump_json(), px=int(ttl_s * 1000))
    await client.publish(keys.channel, reg.heartbeat(record))
    await client.aclose()


def test_a_redis_restarted_empty_keeps_the_view_until_the_workers_could_register(
        redis_server):
    async def main():
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        await until(lambda: router.connected, what="the router to subscribe")
        await publish_heartbeat(redis_server.url, "w1", ttl_s=3.0)
        await until(lambda: URL in router.endpoints, what="the worker to join")

        redis_server.stop()
        await until(lambda: not router.connected, what="the router to notice")
        redis_server.start()  # empty; the worker has not heartbeated since
        await until(lambda: router.connected, timeout=10, what="the router to reconnect")
        # Caught up from an empty Redis: the worker still routes (its next heartbeat is
        # due), not a 503 "no healthy worker" until then.
        assert [(e.url, e.healthy) for e in router.all()] == [(URL, True)]

        await publish_heartbeat(redis_server.url, "w1", ttl_s=3.0)  # registered again
        await asyncio.sleep(0.2)
        assert [e.url for e in router.all()] == [URL]
        # One that never comes back is dropped one TTL later.
        await until(lambda: not router.endpoints, timeout=6, what="the silent one to expire")
        # nothing of that was junk: subscription confirmations and the pings' pongs of the
        # quiet seconds are not counted as skipped messages
        assert router.skipped == 0
        await router.stop()
    asyncio.run(main())


GARBAGE = [
    b"not json",
    b"[" * 100_000,  # deep JSON
    json.dumps({"v": 1, "kind": "leave"}).encode(),  # no id
    json.dumps({"v": 1, "kind": "blocks", "id": "w1"}).encode(),  # no seq
    json.dumps({"v": 1, "kind": "blocks", "id": "w1", "seq": "x", "added": 3,
                "removed": []}).encode(),
    json.dumps({"v": 1, "kind": "blocks", "id": ["w1"], "seq": 1, "added": [],
                "removed": []}).encode(),
    json.dumps({"v": 1, "kind": "heartbeat", "record": {"url": 5}}).encode(),
    json.dumps([1, 2, 3]).encode(),
    b"x" * (2 << 20),  # over the size bound
]


def test_a_garbage_flood_on_the_channel_never_drops_the_subscription(redis_server, caplog):
    async def main():
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        await until(lambda: router.connected, what="the router to subscribe")
        await publish_heartbeat(redis_server.url, "w1", ttl_s=30.0)
        await until(lambda: URL in router.endpoints, what="the worker to join")
        client = reg.redis_client(redis_server.url)
        channel = reg.Keys().channel
        for _ in range(20):
            for junk in GARBAGE:
                await client.publish(channel, junk)
        # Block events of ids nobody registered: not one catch-up, not one mirror.
        for seq in range(200):
            await client.publish(channel, reg.blocks(f"ghost-{seq}", seq + 5, ["ab"], []))
        await client.aclose()
        await publish_heartbeat(redis_server.url, "w2", ttl_s=30.0)  # after the flood
        await until(lambda: URL in router.endpoints and router.endpoints[URL].worker_id
                    == "w2", timeout=10, what="a heartbeat after the flood")
        assert router.connected
        assert not any(k.startswith("ghost") for k in router.blocks.held)
        await router.stop()
        return router

    with caplog.at_level(logging.INFO, logger="baton.router"):
        router = asyncio.run(main())
    assert "unreachable" not in caplog.text  # the subscription was never dropped
    assert router.skipped == 20 * len(GARBAGE)
    assert caplog.text.count("not registry events") <= 3  # rate-limited
