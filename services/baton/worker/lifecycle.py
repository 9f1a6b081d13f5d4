"""How a worker process ends: a graceful drain on SIGTERM, and a non-zero exit when its
engine loop dies (so Kubernetes or `baton up` restarts it).

    SIGTERM -> `/ready` answers 503 at once, the worker leaves the registry, new requests
    get 503 (routers send them elsewhere), in-flight requests finish, and a prefill pod
    keeps serving pulls of the leases it holds until they are pulled or expire; then the
    server stops. `--drain-timeout` bounds all of it; a second SIGTERM / SIGINT stops at once.

`Inflight` is the ASGI middleware that counts requests still being answered (a stream counts
until its last byte). `WorkerServer` is uvicorn's server with that signal handling.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from baton.common.http_limits import HEADER_TIMEOUT_S, httptools_protocol
from baton.worker.state import WorkerState

log = logging.getLogger("baton.worker")

# Paths whose requests a drain waits for; probes and scrapes are not work.
_WORK_PREFIXES = ("/v1/", "/internal/prefill", "/internal/generate")
ENGINE_WATCH_S = 0.5


class Inflight:
    """ASGI middleware: `count` is the number of work requests (`_WORK_PREFIXES`) whose
    response has not ended."""

    def __init__(self, app) -> None:
        self.app = app
        self.count = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_WORK_PREFIXES):
            return await self.app(scope, receive, send)
        self.count += 1
        done = False

        async def sending(message) -> None:
            nonlocal done
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                if not done:
                    done = True
                    self.count -= 1

        try:
            await self.app(scope, receive, sending)
        finally:
            if not done:
                self.count -= 1


class WorkerServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM drains (see the module doc) instead of closing
    the listening socket at once, and which stops when the engine loop dies."""

    def __init__(self, config: uvicorn.Config, state: WorkerState, inflight: Inflight,
                 drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.inflight, self.drain_timeout_s = state, inflight, drain_timeout_s
        self._watch: asyncio.Task | None = None
        # held here: the loop keeps only a weak reference to a task, and a drain task that
        # is collected mid-await never sets should_exit (the worker then ignores SIGTERM)
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self._watch = asyncio.create_task(self._watch_engine())

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self.state.draining or self.state.engine is None:
            super().handle_exit(sig, frame)  # Ctrl-C, a second signal, or nothing to drain
            return
        self.state.draining = True  # at once: /ready turns 503 before the drain task runs
        loop = asyncio.get_running_loop()  # this handler runs on the loop's (main) thread
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.inflight, self.drain_timeout_s)
        finally:
            self.should_exit = True

    async def _watch_engine(self) -> None:
        """A dead engine loop ends the process (exit code 1 through `state.exit_code`)."""
        while not self.should_exit:
            engine = self.state.engine
            if engine is not None and engine.dead_error is not None:
                log.error("the engine loop died (%r); exiting so the worker is restarted",
                          engine.dead_error)
                self.state.exit_code = 1
                self.should_exit = True
                return
            await asyncio.sleep(ENGINE_WATCH_S)

    async def shutdown(self, sockets=None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await super().shutdown(sockets)


async def drain(state: WorkerState, inflight: Inflight, timeout_s: float) -> None:
    """Stop taking work and wait (at most `timeout_s`) until nothing is in flight and no
    lease is held; what is still running after it is cut off by the shutdown."""
    t0 = time.monotonic()
    state.draining = True
    log.info("draining: %d requests in flight, up to %.0fs", inflight.count, timeout_s)
    if state.registration is not None:
        await state.registration.stop()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline and (inflight.count or state.leases_held()):
        await asyncio.sleep(0.1)
    left = inflight.count, state.leases_held()
    if any(left):
        log.warning("drain timed out after %.0fs: %d requests in flight, %d leases held",
                    timeout_s, *left)
    else:
        log.info("drained in %.1fs", time.monotonic() - t0)


# How long an idle kept-alive connection stays open: longer than the router's pooled
# connections live (60 s, `router.app`) and than common clients' pools, so the client end
# closes first. uvicorn's default, 5 s, raced clients that reuse a connection after a pause
# of about that long (a chat session's think time): the request met a reset connection.
KEEP_ALIVE_S = 75


def serve(app, state: WorkerState, host: str, port: int, log_level: str,
          drain_timeout_s: float, header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
    """Run the worker's app until it is stopped (drained, interrupted, engine dead); Ctrl-C
    returns quietly (exit 0), as SIGTERM does. A connection whose request head takes longer than `header_timeout_s` is closed."""
    inflight = Inflight(app)
    config = uvicorn.Config(inflight, host=host, port=port, log_level=log_level,
                            access_log=False, loop="uvloop",
                            http=httptools_protocol(header_timeout_s),
                            timeout_graceful_shutdown=5, log_config=None,
                            timeout_keep_alive=KEEP_ALIVE_S)
    try:
        WorkerServer(config, state, inflight, drain_timeout_s).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on: a clean stop
        log.info("worker on port %d stopped (interrupted)", port)
