"""A worker's presence in the Redis registry (`common.registry`): its record with a
heartbeat, and the hashes of the KV blocks it holds as they come and go.

One task on the worker's event loop. Every `interval_s` it refreshes the record (TTL
`3 * interval_s`) and announces it; every `flush_s` it folds the block pool's events into
the block set and announces them. When Redis is unreachable the worker keeps serving, drops
the events it cannot send, retries with backoff, and on reconnect writes a fresh snapshot
of its blocks (Redis may have restarted empty). On shutdown it announces that it leaves.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from baton.common import registry as reg

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from baton.engine.kv_cache.block_pool import BlockPool

log = logging.getLogger("baton.worker")
STOP_TIMEOUT_S = 5.0  # leaving the registry never holds up a drain longer than this


class Registration:
    def __init__(self, url: str, advertise_url: str, report: Callable[[], dict | None],
                 prefix: str = reg.DEFAULT_PREFIX, interval_s: float = 1.0,
                 flush_s: float = 0.1, worker_id: str | None = None) -> None:
        """`report()` returns the record's fields (role, model, load …), or None while the
        engine is loading (nothing is registered before it is ready). `worker_id`: the id
        to register under (the worker's own, which it names on every answer); None: a new
        one."""
        if interval_s <= 0 or flush_s <= 0:
            raise ValueError("Registration: interval_s and flush_s must be > 0")
        self.url, self.advertise_url = url, advertise_url.rstrip("/")
        self.keys = reg.Keys(prefix)
        self.report = report
        self.interval_s, self.flush_s = interval_s, flush_s
        self.id = worker_id or uuid.uuid4().hex[:16]
        self.pool: BlockPool | None = None  # the engine's block events, once loaded
        self._seq = 0
        self._popped = 0
        self._synced = False  # the block set in Redis is ours (written since connecting)
        self._failing = False  # the last attempt failed (logged once per outage)
        self._task: asyncio.Task | None = None
        self._redis: Redis | None = None

    @property
    def _client(self) -> Redis:
        assert self._redis is not None  # start() made it, before anything talks to Redis
        return self._redis

    def attach(self, pool) -> None:
        """Start recording the block pool's hash events: `pool` is what the engine's
        `AsyncEngine.block_events()` returns (call once the engine is loaded)."""
        pool.record_events()
        self.pool = pool

    def start(self) -> None:
        self._redis = reg.redis_client(self.url)
        self._task = asyncio.create_task(self._run())

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Leave the registry (once; a drain calls it before the shutdown does), within
        `timeout_s`: past it the worker goes on stopping and the record's TTL ends it."""
        if self._task is None:
            return
        task, self._task = self._task, None
        task.cancel()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(task, return_exceptions=True)
                await self._leave()
        except TimeoutError:
            log.warning("registry: leaving took over %.0fs; the TTL will end the record",
                        timeout_s)

    async def _leave(self) -> None:
        try:  # best effort: routers also drop us when the TTL runs out
            async with self._client.pipeline(transaction=True) as p:
                p.delete(self.keys.worker(self.id), self.keys.blocks(self.id),
                         self.keys.blockseq(self.id))
                p.publish(self.keys.channel, reg.leave(self.id))
                await p.execute()
        except Exception as err:  # noqa: BLE001 - Redis down at shutdown: the TTL does it
            log.info("registry: could not announce leaving (%r); the TTL will", err)
        await self._client.aclose()

    # -- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.1
        ticks_per_beat = max(1, round(self.interval_s / self.flush_s))
        tick = 0
        while True:
            try:
                if tick % ticks_per_beat == 0:
                    await self._beat()
                await self._flush()
                if self._failing:
                    log.info("registry at %s reachable again", self.url)
                self._failing, backoff = False, 0.1
                tick += 1
                await asyncio.sleep(self.flush_s)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Redis down: keep serving, retry
                if not self._failing:
                    log.warning("registry at %s unreachable (%r); serving on, retrying",
                                self.url, err)
                self._failing, self._synced = True, False
                self._drain()  # what happens meanwhile is covered by the next snapshot
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                tick = 0

    async def _beat(self) -> None:
        fields = self.report()
        if fields is None:
            return
        record = reg.WorkerRecord(id=self.id, url=self.advertise_url,
                                  ttl_s=3 * self.interval_s, **fields)
        ttl_ms = int(record.ttl_s * 1000)
        async with self._client.pipeline(transaction=True) as p:
            p.set(self.keys.worker(self.id), record.model_dump_json(), px=ttl_ms)
            p.pexpire(self.keys.blocks(self.id), ttl_ms)
            p.pexpire(self.keys.blockseq(self.id), ttl_ms)
            p.publish(self.keys.channel, reg.heartbeat(record))
            await p.execute()

    async def _flush(self) -> None:
        if self.pool is None:
            return
        if not self._synced:
            await self._snapshot()
            return
        drained = self._drain()
        if drained is None:  # events lost to the queue's bound, or the pool was reset
            await self._snapshot()
            return
        added, removed = drained
        if not (added or removed):
            return
        await self._send(added, removed, reset=False)

    async def _snapshot(self) -> None:
        self._drain()
        assert self.pool is not None  # _flush checked
        await self._send(self.pool.held_hashes(), [], reset=True)
        if not self._synced:
            log.info("registry: registered at %s as %s", self.url, self.id)
        self._synced = True

    async def _send(self, added: list[tuple[int, str]], removed: list[tuple[int, str]],
                    reset: bool) -> None:
        """Fold (hash, tier) changes into the block set and announce them."""
        self._seq += 1
        add = [reg.member(reg.hash_hex(h), tier) for h, tier in added]
        rem = [reg.member(reg.hash_hex(h), tier) for h, tier in removed]
        ttl_ms = int(3 * self.interval_s * 1000)
        key = self.keys.blocks(self.id)
        async with self._client.pipeline(transaction=True) as p:
            if reset:
                p.delete(key)
            if rem:
                p.srem(key, *rem)
            if add:
                p.sadd(key, *add)
            p.pexpire(key, ttl_ms)
            p.set(self.keys.blockseq(self.id), self._seq, px=ttl_ms)
            p.publish(self.keys.channel, reg.blocks(self.id, self._seq, add, rem, reset))
            await p.execute()

    def _drain(self) -> tuple[list[tuple[int, str]], list[tuple[int, str]]] | None:
        """The pool's (hash, tier) events since the last drain, netted: (added, removed);
        None when some were lost to the queue's bound or the pool was reset (the tiers
        under it were not: resend a snapshot)."""
        pool = self.pool
        events = pool.events if pool is not None else None
        if pool is None or events is None:
            return [], []
        appended = pool.events_appended  # read before len: a racing append is no loss
        lost = appended - self._popped - len(events)
        added: dict[tuple[int, str], None] = {}
        removed: dict[tuple[int, str], None] = {}
        reset = False
        while events:
            stored, h, tier = events.popleft()
            self._popped += 1
            if h is None:  # the pool's cache was cleared
                reset = True
            elif stored:
                removed.pop((h, tier), None)
                added[(h, tier)] = None
            else:
                added.pop((h, tier), None)
                removed[(h, tier)] = None
        if lost > 0:  # the deque dropped the oldest: count them as seen, resend everything
            self._popped += lost
        return None if lost > 0 or reset else (list(added), list(removed))
