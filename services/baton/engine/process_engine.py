"""`AsyncEngine` with its engine core in a child process (`engine.core_process`), vLLM's
engine-core process: the front (this process: HTTP, SSE, validation, grammar checks) and
the core (scheduler, model, detokenisers) each have their own GIL, and every step's outputs
cross in one message (`core_channel.Step`).

The face is `AsyncEngine`'s: requests are validated here with the core's facts (a bad one
is refused before anything crosses), streams read the same batches, `stats()` is the
core's latest snapshot (at most `core_process.STATS_INTERVAL_S` old) and `block_events()`
a mirror of the core's KV pool that its events keep. When the core process dies every
stream fails with `EngineDeadError` and `dead_error` is set (the worker exits non-zero);
when this process dies the core's end of the socket closes and it stops.

    engine = ProcessEngine(config)   # starts the core and waits until it is built
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

from baton.common.registry import DEVICE
from baton.common.stats import EngineStats
from baton.engine import core_channel as ch
from baton.engine import tokenizer as tok
from baton.engine.async_engine import AsyncEngine, EngineDeadError, _Failure
from baton.engine.config import EngineConfig, EngineProcess, LiveSettings
from baton.engine.kv_connector.handoff import PullKV
from baton.engine.request import FINISHED_BY_REASON, Request, RequestStatus
from baton.engine.request_factory import RequestFactory
from baton.engine.structured.manager import StructuredOutputs

log = logging.getLogger(__name__)

# How long a stopping core may take to finish before it is killed.
STOP_TIMEOUT_S = 30.0
# How long `release_lease` waits for the core's answer.
CALL_TIMEOUT_S = 10.0


class CoreDiedError(RuntimeError):
    """The engine core's process ended or broke the channel."""


class ProcessEngine(AsyncEngine):
    def __init__(self, config: EngineConfig) -> None:
        if config.lora.enabled:
            raise ValueError("an engine core in its own process serves no LoRA adapters yet; "
                             "run it in the worker's process (--engine-process off)")
        self._init_front()  # no core here: `core` is not set
        self.config = config
        self._proc, self.channel = _spawn(config)
        try:
            facts = self._first_message().facts
            self._tokenizer = tok.load_tokenizer(Path(facts.model_dir),
                                                 config.checkpoint.skip_tokenizer_init)
            self._requests = RequestFactory(facts, self._tokenizer,
                                            StructuredOutputs.for_tokenizer(
                                                self._tokenizer, facts.vocab_size,
                                                facts.eos_token_id))
        except BaseException:
            self._kill()  # no front: the core must not outlive it
            raise
        self._stats = EngineStats()
        self._applied = 0  # adds the core has taken, as of its last message
        self._durations: deque[float] = deque()  # the reader adds, the event loop takes
        self._pool = PoolMirror()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._sent: dict[str, Request] = {}  # the front's copies of requests in flight
        # Commands leave through a thread of their own: the event loop never waits on the
        # socket (a core busy building a request leaves the socket's buffer full).
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_all, name="baton-core-sender",
                                        daemon=True)
        self._sender.start()

    def _first_message(self) -> ch.Ready:
        try:
            msg = self.channel.recv()
        except ch.ChannelError:
            code = self._proc.wait()
            raise CoreDiedError(f"the engine core exited with {code} while it was built "
                                "(its log is above)") from None
        if isinstance(msg, ch.Died):
            self._proc.wait()
            raise CoreDiedError(f"the engine failed to build: {msg.error}")
        if not isinstance(msg, ch.Ready):
            raise CoreDiedError(f"the engine core's first message is {msg!r}")
        return msg

    # -- AsyncEngine's face ----------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._requests.facts.max_model_len

    @property
    def requests(self) -> RequestFactory:
        return self._requests

    @property
    def lora_registry(self):
        return None  # a LoRA-serving core is refused in __init__

    def stats(self) -> EngineStats:
        return self._stats

    def take_kv_transfer_durations(self) -> list[float]:
        durations = self._durations
        return [durations.popleft() for _ in range(len(durations))]

    async def release_lease(self, lease_id: str) -> bool:
        if self.dead_error is not None:
            return False
        return bool(await self._call(lambda call_id: ch.ReleaseLease(call_id, lease_id)))

    async def sync_stats(self) -> None:
        """Bring `stats()` and the KV pull durations up to the core's now."""
        if self.dead_error is None:
            await self._call(ch.SyncStats)

    async def _call(self, make_msg: Callable[[int], object]) -> object:
        """Send `make_msg(call_id)` and wait for the core's `Reply` to it."""
        call_id = next(self._call_ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            self._send(make_msg(call_id))
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        finally:
            self._calls.pop(call_id, None)

    def block_events(self):
        return self._pool

    def reconfigure(self, live: LiveSettings) -> None:
        self.config.check_live(live)
        self._send(ch.Reconfigure(live))

    @property
    def num_waiting(self) -> int:
        return self._stats.waiting + max(0, self._num_sent - self._applied)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._proc.poll() is None

    def make_request(self, request_id: str, prompt_token_ids: list[int], params,
                     priority: int = 0, *, kv=None, presampled: int = 0, grammar=None,
                     lora=None) -> Request:
        """Validated here (the core builds it again; its grammar compiled there)."""
        return self._requests.make_request(request_id, prompt_token_ids, params, priority,
                                           kv=kv, presampled=presampled, lora=lora,
                                           with_grammar=False)

    def start(self) -> None:
        if self._reader is None:
            self._requests.structured.warm_up()
            self._reader = threading.Thread(target=self._read, name="baton-core-reader",
                                            daemon=True)
            self._reader.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._send(ch.Stop())
        self._outbox.put(None)
        self._sender.join(STOP_TIMEOUT_S)
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine core did not stop within %.0fs; killing it",
                        STOP_TIMEOUT_S)
            self._kill()
        self.channel.close()

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def submit(self, req: Request) -> asyncio.Queue:
        stream = super().submit(req)
        self._sent[req.request_id] = req
        return stream

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._end(request_id, "abort")

    def _deliver(self, outputs) -> None:
        """On the event loop: the front's copy of a request ends with its last output (what
        reads `Request.is_finished` here, as fair admission does, sees it end)."""
        super()._deliver(outputs)
        for o in outputs:
            if isinstance(o, _Failure):
                self._end(o.request_id, "error")
            elif o.finish_reason is not None:
                self._end(o.request_id, o.finish_reason)

    def _end(self, request_id: str, reason: str) -> None:
        req = self._sent.pop(request_id, None)
        if req is not None:
            req.status = FINISHED_BY_REASON.get(reason, RequestStatus.FINISHED_ABORTED)

    def _enqueue(self, kind: str, arg) -> None:
        if kind == "add":
            req: Request = arg
            pulled = isinstance(req.kv_handoff, PullKV)  # its first token came with it
            self._send(ch.Add(req.request_id, req.prompt_token_ids, req.sampling_params,
                              req.priority, req.arrival_time, req.num_presampled - pulled,
                              req.kv_handoff))
        elif kind == "abort":
            self._send(ch.Abort(arg))
        else:
            raise ValueError(f"a core in another process runs no {kind!r} command")

    def _send(self, msg) -> None:
        self._outbox.put(msg)

    def _send_all(self) -> None:
        """The sender thread: the outbox's messages in order, until None or the core's end
        closes (the reader then fails what is in flight)."""
        while (msg := self._outbox.get()) is not None:
            try:
                self.channel.send(msg)
            except OSError:
                return

    # -- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        """Take the core's messages until it ends; then every stream fails."""
        try:
            while True:
                msg = self.channel.recv()
                if isinstance(msg, ch.Step):
                    self._take_step(msg)
                elif isinstance(msg, ch.Reply):
                    future = self._calls.get(msg.call_id)
                    if future is not None and not future.done():
                        future.set_result(msg.value)
                elif isinstance(msg, ch.Died):
                    raise CoreDiedError(f"the engine loop died: {msg.error}")
        except (ch.ChannelError, CoreDiedError) as err:
            if self._stopping:
                return
            code = self._proc.poll()
            error = err if isinstance(err, CoreDiedError) else CoreDiedError(
                f"the engine core process ended (exit code {code}): {err}")
            log.error("%s", error)
            self.dead_error = error
            for future in list(self._calls.values()):
                if not future.done():
                    future.set_exception(EngineDeadError(str(error)))
            self._post([_Failure(rid, error) for rid in list(self._streams)])

    def _take_step(self, msg: ch.Step) -> None:
        if msg.block_events:
            self._pool.apply(msg.block_events)
        if msg.stats is not None:
            self._stats = msg.stats
            self._durations.extend(msg.kv_durations)
        self._applied = msg.applied
        if msg.outputs:
            self._post(msg.outputs)


class PoolMirror:
    """What the core's KV pool holds, kept from its block events; the registry reads it as
    it reads a `BlockPool` (`record_events`, `events`, `events_appended`, `held_hashes`)."""

    def __init__(self) -> None:
        self.events: deque | None = None
        self.events_appended = 0
        self._held: dict[tuple[int, str], None] = {}

    def record_events(self, capacity: int = 1 << 16) -> None:
        self.events = deque(maxlen=capacity)

    def apply(self, events: list[tuple[bool, int | None, str]]) -> None:
        """From the reader thread, in the order the pool made them."""
        held = self._held
        for stored, h, tier in events:
            if h is None:  # the pool's cache was cleared; the tiers under it keep theirs
                self._held = held = {k: None for k in held if k[1] != DEVICE}
            elif stored:
                held[(h, tier)] = None
            else:
                held.pop((h, tier), None)
        if self.events is not None:
            self.events.extend(events)
            self.events_appended += len(events)

    def held_hashes(self) -> list[tuple[int, str]]:
        return list(self._held)


def make_engine(config: EngineConfig, process: EngineProcess = EngineProcess.OFF
                ) -> AsyncEngine:
    """The engine a worker serves with: its core on a thread of this process, or in its
    own process as `process` and the device decide (`auto` keeps a LoRA-serving core on a
    thread, which `ProcessEngine` does not serve yet; `on` with LoRA is refused)."""
    return ProcessEngine(config) if core_apart(config, process) else AsyncEngine(config)


def core_apart(config: EngineConfig, process: EngineProcess) -> bool:
    """Whether `make_engine` runs the core in its own process."""
    lora_here = config.lora.enabled and process == EngineProcess.AUTO
    return process.runs_apart(config.compute.device) and not lora_here


def _spawn(config: EngineConfig) -> tuple[subprocess.Popen, ch.Channel]:
    """Start `python -m baton.engine.core_process` on one end of a socket pair; send it
    the config."""
    ours, theirs = socket.socketpair()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "baton.engine.core_process",
                             str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    channel = ch.Channel(Connection(ours.detach()), ch.CORE_MESSAGES)
    channel.send(ch.Start(config))
    return proc, channel

