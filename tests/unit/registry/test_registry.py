"""The Redis registry end to end in one process: workers' `Registration` (with a real block
pool producing hash events) and the router's `RegistryDiscovery`, against a real
valkey-server — joining, load updates, block hashes, leaving, crashing, gaps in the
event stream, and Redis restarting empty."""

from __future__ import annotations

import asyncio
import time

import pytest

from baton.common import registry as reg
from baton.common.hashing import hash_token_blocks
from baton.engine.kv_cache.block_pool import BlockPool
from baton.router.redis_discovery import RegistryDiscovery
from baton.worker.registration import Registration

INTERVAL = 0.2  # heartbeat; the TTL is 3x


def report(role: str = "decode", running: int = 0) -> dict:
    return {"role": role, "model": "m", "ready": True, "running": running, "waiting": 0,
            "kv_blocks_used": 1, "kv_blocks_total": 10, "max_waiting": 8,
            "max_model_len": 2048, "block_size": 4, "kv_transport": "tcp"}


def matched(router: RegistryDiscovery, url: str, hashes: list[str]) -> int:
    """Leading blocks of `hashes` the router's exact index says the worker at `url` holds."""
    ep = router.endpoints.get(url)
    return router.blocks.match(ep, hashes) if ep is not None else 0


async def until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def store(pool: BlockPool, tokens: list[int]) -> list[str]:
    """Cache the full blocks of `tokens` in fresh blocks, as a finished prefill does."""
    hashes = hash_token_blocks(tokens, 4)
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    pool.free(blocks)
    return [reg.hash_hex(h) for h in hashes]


def worker(url: str, redis_url: str, state: dict) -> Registration:
    r = Registration(redis_url, url, lambda: state.get("report"), interval_s=INTERVAL,
                     flush_s=0.05)
    pool = BlockPool(64, enable_caching=True)
    r.attach(pool)
    return r


def test_join_load_blocks_and_leave(redis_server):
    async def main():
        state = {"report": report()}
        w = worker("http://10.0.0.1:8001", redis_server.url, state)
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        await router.wait_first_round(2)
        assert router.all() == []
        w.start()
        await until(lambda: router.all(), what="the worker to join")
        ep = router.endpoints["http://10.0.0.1:8001"]
        assert (ep.role, ep.model, ep.healthy, ep.max_waiting) == ("decode", "m", True, 8)

        state["report"] = report(running=5)  # load follows the heartbeat
        await until(lambda: ep.running == 5, what="the load update")

        held = store(w.pool, list(range(20)))  # 5 blocks of 4 tokens
        await until(lambda: matched(router, ep.url, held) == 5, what="the block hashes")
        other = [reg.hash_hex(h) for h in hash_token_blocks(list(range(8)) + [99] * 8, 4)]
        assert matched(router, ep.url, other) == 2  # shares the first two blocks only

        w.pool.allocate(64)  # reuses every free block: all cached contents are evicted
        await until(lambda: matched(router, ep.url, held) == 0, what="the evictions")

        await w.stop()  # a clean shutdown announces it leaves
        await until(lambda: not router.all(), timeout=INTERVAL * 2, what="the leave")
        await router.stop()
    asyncio.run(main())


def test_a_silent_worker_expires_and_a_restarted_one_starts_empty(redis_server):
    async def main():
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        state = {"report": report()}
        w = worker("http://10.0.0.2:8001", redis_server.url, state)
        w.start()
        held = store(w.pool, list(range(16)))
        await until(lambda: matched(router, "http://10.0.0.2:8001", held) == 4)

        w._task.cancel()  # the process froze or died: no leave, no more heartbeats
        t0 = time.monotonic()
        await until(lambda: not router.all(), timeout=5, what="the TTL expiry")
        assert time.monotonic() - t0 < 3 * INTERVAL + 1.0

        again = worker("http://10.0.0.2:8001", redis_server.url, {"report": report()})
        again.start()  # same address, new process, empty cache
        await until(lambda: router.all(), what="the restarted worker")
        assert router.endpoints["http://10.0.0.2:8001"].worker_id == again.id
        assert matched(router, "http://10.0.0.2:8001", held) == 0
        await again.stop()
        await router.stop()
        await w._redis.aclose()
    asyncio.run(main())


def test_a_gap_in_block_events_is_caught_up_from_the_keys(redis_server):
    async def main():
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        w = worker("http://10.0.0.3:8001", redis_server.url, {"report": report()})
        w.start()
        await until(lambda: router.all())
        held = store(w.pool, list(range(12)))
        await until(lambda: matched(router, "http://10.0.0.3:8001", held) == 3)
        # An event the router never hears (as if its message was lost): the set changes
        # and the next event's number skips one.
        extra = "abc123"
        keys = reg.Keys()
        await w._redis.sadd(keys.blocks(w.id), extra)
        w._seq += 1
        await w._redis.set(keys.blockseq(w.id), w._seq)
        held2 = store(w.pool, list(range(100, 108)))
        await until(lambda: matched(router, "http://10.0.0.3:8001", held2) == 2)
        assert extra in router.blocks.held[w.id]  # read from the keys, not the events
        await w.stop()
        await router.stop()
    asyncio.run(main())


def test_routing_survives_a_redis_restart(redis_server):
    async def main():
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        w = worker("http://10.0.0.4:8001", redis_server.url, {"report": report()})
        w.start()
        held = store(w.pool, list(range(16)))
        await until(lambda: matched(router, "http://10.0.0.4:8001", held) == 4)

        redis_server.stop()
        await until(lambda: not router.connected, what="the router to notice")
        await asyncio.sleep(6 * INTERVAL)  # well past the TTL: the last view stays
        assert [e.url for e in router.all()] == ["http://10.0.0.4:8001"]
        assert matched(router, "http://10.0.0.4:8001", held) == 4

        redis_server.start()  # back, and empty: the worker registers and resends its blocks
        await until(lambda: router.connected, timeout=10, what="the router to reconnect")
        keys = reg.Keys()
        async def registered():
            return await w._redis.exists(keys.worker(w.id), keys.blocks(w.id)) == 2
        deadline = time.monotonic() + 10
        while not await registered():
            assert time.monotonic() < deadline, "the worker did not re-register"
            await asyncio.sleep(0.05)
        more = store(w.pool, list(range(200, 208)))
        await until(lambda: matched(router, "http://10.0.0.4:8001", more) == 2)
        assert matched(router, "http://10.0.0.4:8001", held) == 4
        await w.stop()
        await router.stop()
    asyncio.run(main())


def test_unknown_messages_and_bad_prefixes_are_refused():
    assert reg.parse_event(b"not json") is None
    assert reg.parse_event('{"v": 99, "kind": "heartbeat"}') is None
    assert reg.parse_event('{"v": 1, "kind": "heartbeat", "record": {"id": "x"}}') is None
    with pytest.raises(ValueError, match="prefix"):
        reg.Keys("a:b")


def test_a_redis_with_a_password(tmp_path):
    """The registry URL carries the password (from $BATON_REDIS_URL, a Secret, in a
    cluster); without it the worker cannot register and says why, never hangs."""
    from tests.redis_server import RedisServer, server_binary

    server = RedisServer(server_binary(), tmp_path / "redis.log", password="s3cret-pw").start()
    try:
        async def go():
            state = {"report": report()}
            good = worker("http://w1:8001", server.url, state)
            router = RegistryDiscovery(server.url, "baton")
            good.start()
            await router.start(None)
            try:
                await until(lambda: "http://w1:8001" in router.endpoints, what="w1 to join")
            finally:
                await good.stop()
                await router.stop()
            anonymous = reg.redis_client(server.url.replace(":s3cret-pw@", ""))
            with pytest.raises(Exception, match="(?i)auth"):
                await anonymous.ping()
            await anonymous.aclose()

        asyncio.run(go())
    finally:
        server.stop()
