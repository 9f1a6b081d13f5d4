"""Discovery from the Redis registry (`common.registry`): the workers that heartbeat, and
the KV block hashes each one holds (`prefix.BlockIndex`).

One subscription to the registry's channel per router: heartbeats update an endpoint's
load (or add it), a `leave` or a heartbeat older than the worker's TTL removes it, block
events keep a mirror of each worker's hash set. The keys are read only to catch up: after
(re)subscribing, and for a worker whose block events skip a number. If Redis goes away the
router keeps routing from its last view (no endpoint expires while it cannot hear
heartbeats; the circuit breakers still take failing workers out) and reconnects with
backoff. A Redis that comes back empty (restarted without a volume) does not empty the view:
a worker whose key is missing after a reconnect keeps routing for one TTL from then, the
time its next heartbeats take to register it again; only one that stays silent is dropped.

Whatever else is published on the channel (another version, garbage, a message over
`registry.MAX_EVENT_BYTES`, block events of a worker nobody registered) is skipped and
counted, logged at most once a second: never a reason to drop the subscription.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from baton.common import registry as reg
from baton.router.discovery import BreakerSettings, Discovery, Upstream, update
from baton.router.prefix import BlockIndex

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.client import PubSub

log = logging.getLogger("baton.router")


class RegistryDiscovery(Discovery):
    """`endpoints` and `blocks` (the exact `PrefixIndex`) as the registry's channel tells
    them; both are changed only by this object's task, on the event loop."""

    def __init__(self, url: str, prefix: str = reg.DEFAULT_PREFIX,
                 breaker: BreakerSettings | None = None, timeout_s: float = 2.0) -> None:
        self.url = url
        self.keys = reg.Keys(prefix)
        self.breaker = breaker or BreakerSettings()
        self.timeout_s = timeout_s
        self.endpoints: dict[str, Upstream] = {}
        self.blocks = BlockIndex()
        self.connected = False
        self.skipped = 0  # messages on the channel that were not events of ours
        self._skip_logged, self._skip_count = float("-inf"), 0
        self._first_round = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._redis: Redis | None = None

    @property
    def _client(self) -> Redis:
        assert self._redis is not None  # start() made it, before anything talks to Redis
        return self._redis

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._redis = reg.redis_client(self.url, self.timeout_s)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

    # -- following the channel -------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.channel)
                await self._catch_up()  # after subscribing: nothing falls in between
                if not self.connected:
                    log.info("registry %s: following %d workers", self.url,
                             len(self.endpoints))
                self.connected, backoff = True, 0.1
                self._first_round.set()
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Redis away: keep the last view
                if self.connected:
                    log.warning("registry %s unreachable (%r); routing from the last view "
                                "of %d workers", self.url, err, len(self.endpoints))
                self.connected = False
                self._first_round.set()  # routing starts from what there is (nothing)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # unannotated in redis-py

    async def _listen(self, pubsub: PubSub) -> None:
        quiet_since = time.monotonic()
        while True:
            msg = await pubsub.get_message(timeout=0.5)
            now = time.monotonic()
            if msg is not None and msg.get("type") != "message":
                quiet_since = now  # our subscription's confirmations, pings' pongs
            elif msg is not None:
                quiet_since = now
                data = msg.get("data")
                event = reg.parse_event(data) if isinstance(data, bytes | str) else None
                if event is None:
                    self._skipped(now, data)
                else:
                    await self._on_event(event)
            elif now - quiet_since > 2.0:  # nothing heard: is the connection alive?
                await pubsub.ping()
                quiet_since = now
            self._expire(now)

    async def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "heartbeat":
            self._heartbeat(event["record"])
        elif kind == "leave":
            self._remove(event["id"], "left")
        elif kind == "blocks" and self._registered(event["id"]) \
                and not self.blocks.apply(event):
            await self._catch_up_blocks(event["id"])

    def _registered(self, worker_id: str) -> bool:
        """Whether `worker_id` is a worker of the view (block events of others: skipped)."""
        return any(ep.worker_id == worker_id for ep in self.endpoints.values())

    def _skipped(self, now: float, data: object) -> None:
        """A message that is no event of ours: counted, logged at most once a second."""
        self.skipped += 1
        if now - self._skip_logged >= 1.0:
            size = len(data) if isinstance(data, bytes | str) else 0
            log.warning("registry %s: skipped %d messages on %s that are not registry events "
                        "(the last one %d bytes)", self.url, self.skipped - self._skip_count,
                        self.keys.channel, size)
            self._skip_logged, self._skip_count = now, self.skipped

    def _heartbeat(self, record: reg.WorkerRecord) -> None:
        ep = self.endpoints.get(record.url)
        if ep is None or ep.worker_id != record.id:
            if ep is not None:  # the same address, a new process: its cache is empty
                self.blocks.drop(_worker_id(ep))
                ep.set_healthy(False)  # the old process is gone
            else:
                log.info("worker %s joined (model %s, role %s)", record.url, record.model,
                         record.role)
            ep = self.endpoints[record.url] = Upstream(record.url, worker_id=record.id)
        update(ep, record)
        ep.ttl_s = record.ttl_s

    def _remove(self, worker_id: str, why: str) -> None:
        for url, ep in list(self.endpoints.items()):
            if ep.worker_id == worker_id:
                del self.endpoints[url]
                ep.set_healthy(False)
                log.info("worker %s %s", url, why)
        self.blocks.drop(worker_id)

    def _expire(self, now: float) -> None:
        for ep in list(self.endpoints.values()):
            if now - ep.last_seen > ep.ttl_s:
                self._remove(_worker_id(ep), f"stopped heartbeating ({ep.ttl_s:g}s)")

    # -- catching up from the keys ---------------------------------------------------------
    async def _catch_up(self) -> None:
        """Read every record and block set. A worker whose key is gone keeps one TTL from
        now to register again (its heartbeats re-create it), then `_expire` drops it."""
        keys = [k async for k in self._client.scan_iter(self.keys.worker_pattern, count=500)]
        records = await self._client.mget(keys) if keys else []
        seen = set()
        for raw in records:
            if raw is None:
                continue
            try:
                record = reg.WorkerRecord.model_validate_json(raw)
            except ValueError:
                continue
            seen.add(record.id)
            self._heartbeat(record)
            await self._catch_up_blocks(record.id)
        now = time.monotonic()
        for ep in list(self.endpoints.values()):
            if ep.worker_id not in seen:  # a Redis restarted empty: let it register again
                log.info("worker %s is not in the registry; keeping it for its TTL (%gs) "
                         "while it registers again", ep.url, ep.ttl_s)
                ep.last_seen = now

    async def _catch_up_blocks(self, worker_id: str) -> None:
        async with self._client.pipeline(transaction=True) as p:
            p.smembers(self.keys.blocks(worker_id))
            p.get(self.keys.blockseq(worker_id))
            members, seq = await p.execute()
        self.blocks.drop(worker_id)
        if seq is not None:
            self.blocks.replace(worker_id, {m.decode() if isinstance(m, bytes) else m
                                            for m in members}, int(seq))


def _worker_id(ep: Upstream) -> str:
    # every endpoint of a RegistryDiscovery is made in _heartbeat, with worker_id=record.id
    assert ep.worker_id is not None
    return ep.worker_id
