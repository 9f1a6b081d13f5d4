"""Which workers exist and how they are doing.

`Upstream` is the router's view of one worker: what its health checks last said (role,
model, load, KV usage), what the router itself has in flight there, and a circuit breaker
that takes a worker out of routing after consecutive failures for a cool-down.

Two sources share the `Discovery` base (the endpoints and their breakers):
`StaticDiscovery` is the local-mode source (`--workers URL,...`), a checker task polling
each worker's `/load` (which doubles as the readiness check) on a fixed interval;
`router.redis_discovery.RegistryDiscovery` follows the Redis registry (`--registry`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from baton.common.registry import LoadReport
from baton.common.roles import Role

log = logging.getLogger("baton.router")
MAX_LOAD_REPORT_BYTES = 64 << 10  # a load report is a few hundred bytes


@dataclass
class Upstream:
    url: str
    role: str = Role.BOTH  # as the worker reports it (a `Role` name)
    model: str | None = None  # the primary served name
    models: tuple[str, ...] = ()  # every name it serves, the primary first
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters it serves (requests may name them)
    lora_loaded: tuple[str, ...] = ()  # of those, the ones it holds a host copy of
    lora_roots: dict[str, str] = field(default_factory=dict)  # adapter -> KV hash root (hex)
    max_model_len: int | None = None
    healthy: bool = False
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    max_waiting: int | None = None
    inflight: int = 0  # requests this router has open there now
    consecutive_failures: int = 0
    open_until: float = 0.0  # circuit breaker: excluded from routing until then
    last_seen: float = 0.0
    worker_id: str | None = None  # the registry's id of the process behind the URL
    ttl_s: float = 0.0  # registry: gone when no heartbeat came for this long
    _down_watchers: set[Callable[[], None]] = field(default_factory=set, init=False,
                                                    repr=False, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        """Every model name it serves, the primary first (none before its first report)."""
        return self.models or ((self.model,) if self.model else ())

    def serves(self, name: str) -> bool:
        """Whether a request for model `name` may go here (any of its served names, or one
        of its LoRA adapters)."""
        return name in self.names or name in self.lora_adapters

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def queue_depth(self) -> int:
        """Requests at the worker: its own report or what we sent, whichever is larger
        (reports lag; other routers' requests only show in reports)."""
        return max(self.running + self.waiting, self.inflight)

    def circuit_open(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) < self.open_until

    def set_healthy(self, healthy: bool) -> None:
        """The health checks' (or the registry's) verdict. Going down calls the `on_down`
        watchers at once (requests waiting on this worker give up on it)."""
        was, self.healthy = self.healthy, healthy
        if was and not healthy:
            for watcher in list(self._down_watchers):
                watcher()

    def on_down(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """Calls `watcher` (on the event loop) if this worker is marked down; returns the
        function that stops watching."""
        self._down_watchers.add(watcher)
        return lambda: self._down_watchers.discard(watcher)


@dataclass(frozen=True)
class BreakerSettings:
    threshold: int = 3  # consecutive failures that open the circuit
    cooldown_s: float = 5.0


class Discovery(ABC):
    """The upstreams a router routes to, and their circuit breakers. Subclasses fill
    `endpoints` (URL -> Upstream) and implement start/stop; the relay and the remote
    prefill report outcomes (on the event loop)."""

    endpoints: dict[str, Upstream]
    breaker: BreakerSettings
    _first_round: asyncio.Event  # set once the first look at the workers is done

    def all(self) -> list[Upstream]:
        return list(self.endpoints.values())

    @abstractmethod
    async def start(self, session: aiohttp.ClientSession) -> None:
        """Begin following the workers (tasks on the running loop)."""

    @abstractmethod
    async def stop(self) -> None:
        """Cancel what `start` began."""

    async def wait_first_round(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._first_round.wait(), timeout)
        except TimeoutError:
            pass

    # -- outcomes reported by the relay and the remote prefill ------------------------------
    def record_success(self, ep: Upstream) -> None:
        ep.consecutive_failures = 0
        ep.open_until = 0.0

    def record_misbehaviour(self, ep: Upstream, problem: str) -> None:
        """`ep` answered what no Baton worker answers (`router.answers`): a server that is
        not one, or broken; its circuit opens at once, for the cool-down."""
        ep.consecutive_failures = max(ep.consecutive_failures + 1, self.breaker.threshold)
        ep.open_until = time.monotonic() + self.breaker.cooldown_s
        log.warning("circuit open for %s: it is not answering as a Baton worker (%s)",
                    ep.url, problem)

    def record_failure(self, ep: Upstream) -> None:
        ep.consecutive_failures += 1
        if ep.consecutive_failures >= self.breaker.threshold:
            ep.open_until = time.monotonic() + self.breaker.cooldown_s
            log.warning("circuit open for %s after %d consecutive failures", ep.url,
                        ep.consecutive_failures)


@dataclass
class StaticDiscovery(Discovery):
    urls: list[str]
    check_interval_s: float = 1.0
    check_timeout_s: float = 1.0
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("StaticDiscovery needs at least one worker URL")
        self.endpoints = {u.rstrip("/"): Upstream(u.rstrip("/")) for u in self.urls}
        self._task: asyncio.Task[None] | None = None
        self._first_round = asyncio.Event()

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._loop(session))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.gather(*(self.check(session, ep) for ep in self.all()))
            self._first_round.set()
            await asyncio.sleep(self.check_interval_s)

    async def check(self, session: aiohttp.ClientSession, ep: Upstream) -> None:
        """Read `ep`'s load report; whatever it answers (an error, a timeout, an answer that
        is not a load report) marks only `ep` down, and the next round checks it again."""
        try:
            report = await self._load_report(session, ep)
        except Exception as err:  # noqa: BLE001 - any bad answer: this worker down, no other
            report = None
            if ep.healthy:
                log.warning("worker %s failed its health check: %r", ep.url, err)
        was = ep.healthy
        if report is None or not report.ready:
            ep.set_healthy(False)
            return
        update(ep, report)
        if not was:
            log.info("worker %s is ready (model %s, role %s)", ep.url, ep.model, ep.role)


    async def _load_report(self, session: aiohttp.ClientSession, ep: Upstream
                           ) -> LoadReport | None:
        timeout = aiohttp.ClientTimeout(total=self.check_timeout_s)
        async with session.get(ep.url + "/load", timeout=timeout) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(MAX_LOAD_REPORT_BYTES + 1)
        if len(body) > MAX_LOAD_REPORT_BYTES:
            raise ValueError(f"a /load answer over {MAX_LOAD_REPORT_BYTES} bytes")
        return LoadReport.model_validate_json(body)


def update(ep: Upstream, report: LoadReport) -> None:
    """Take a worker's load report (`/load`, or a registry heartbeat's record)."""
    ep.set_healthy(report.ready)
    ep.last_seen = time.monotonic()
    ep.role, ep.model = report.role, report.model
    ep.models = tuple(report.models or [ep.model])  # older workers: one name
    ep.lora_adapters, ep.lora_loaded = tuple(report.lora_adapters), tuple(report.lora_loaded)
    ep.lora_roots = dict(report.lora_roots)
    ep.max_model_len = report.max_model_len
    ep.running, ep.waiting = report.running, report.waiting
    ep.kv_blocks_used = report.kv_blocks_used
    ep.kv_blocks_total = report.kv_blocks_total
    ep.max_waiting = report.max_waiting
