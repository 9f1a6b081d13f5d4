"""The asyncio front of the engine, for the services.

The engine loop runs on its own thread; the event loop only validates requests, enqueues
commands and reads per-request queues, so it never blocks on a model step. Outputs of one
step reach the event loop in one `call_soon_threadsafe`.

This is the services' whole view of the engine (the facade): build and submit requests,
read their output batches (`stream`), abort them, read stats (`stats`,
`take_kv_transfer_durations`), retune it live (`reconfigure`) and follow its KV block
events (`block_events`). Nothing outside reaches into `core`.

    engine = AsyncEngine(EngineConfig())
    async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].delta_text, end="")
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from baton.common.sampling_params import SamplingParams, StructuredOutput
from baton.common.stats import EngineStats
from baton.engine.config import EngineConfig, LiveSettings
from baton.engine.core import EngineCore
from baton.engine.errors import InvalidRequestError
from baton.engine.kv_connector.handoff import KVHandoff
from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.lora.registry import AdapterRegistry
from baton.engine.outputs import CompletionOutput, EngineOutput, RequestOutput
from baton.engine.request import Request
from baton.engine.request_factory import RequestFactory
from baton.engine.structured.base import CompiledGrammar, GrammarCompileError

log = logging.getLogger(__name__)

ENGINE_THREAD_NAME = "baton-engine"
# Threads compiling requests' grammars: two slow specs at once still leave the event loop
# and the engine thread theirs (llguidance drops the GIL while it compiles)
GRAMMAR_THREADS = 2
_PR_SET_NAME = 15


class EngineDeadError(RuntimeError):
    """The engine loop crashed; every request in flight fails with this."""


@dataclass
class _Failure:
    """Delivered to a stream instead of an EngineOutput when the engine loop died."""

    request_id: str
    error: BaseException


class AsyncEngine:
    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        self.core = core or EngineCore(config)
        self._init_front()

    def _init_front(self) -> None:
        """The front's state, wherever the core runs (`process_engine` too)."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (the event loop that reads it, its queue)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None
        self._stopping = False
        # Requests queued as commands but not yet in the scheduler: one counter per writer
        # thread, so neither needs a lock.
        self._num_sent = 0
        self._num_applied = 0
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS,
                                                thread_name_prefix="baton-grammar")

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def stats(self) -> EngineStats:
        """Counters and gauges for /metrics and load reports (any thread)."""
        return self.core.metrics_snapshot()

    async def sync_stats(self) -> None:
        """Make `stats()` and `take_kv_transfer_durations` current (an engine core in
        another process sends them now and then: `process_engine`); here they always are."""

    def take_kv_transfer_durations(self) -> list[float]:
        """Seconds each KV pull took since the last call (any thread)."""
        return self.core.take_kv_transfer_durations()

    async def release_lease(self, lease_id: str) -> bool:
        """End a KV lease this (prefill) engine holds that nobody will pull; the loop frees
        its blocks at its next poll. False when no such lease is held or its pull has
        begun."""
        connector = self.core.connector
        return connector is not None and connector.release_lease(lease_id)

    def block_events(self):
        """The KV block pool's stored / evicted hash events (`BlockPool.record_events`),
        for the registry. Read-only use from the event loop."""
        return self.core.kv.pool

    def reconfigure(self, live: LiveSettings) -> None:
        """Apply live-tuned knobs on the engine thread between steps. Raises ValueError at
        once (changing nothing) for limits above those the engine started with."""
        self.core.config.check_live(live)
        self.call_soon(lambda: self.core.reconfigure(live))

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled, including those still on their way to the engine."""
        return self.core.num_waiting + (self._num_sent - self._num_applied)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    def start(self) -> None:
        """Start the engine loop (the grammar engine is built first, so the first
        structured request pays no set-up)."""
        if self._thread is None:
            self.core.structured.warm_up()
            leader = self.core.runner.tp_leader
            if leader is not None:  # a tensor-parallel rank that dies ends an idle loop too
                leader.on_failure(lambda err: self.call_soon(_raising(err)))
            self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the event-loop side ---------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int = 0, *,
                     kv: KVHandoff | None = None, presampled: int = 0,
                     grammar: CompiledGrammar | None = None,
                     lora: LoRAAdapter | None = None) -> Request:
        """Validate and build a request (raises InvalidRequestError); `submit` queues it.
        `kv` / `presampled` / `grammar` / `lora`: see `EngineCore.make_request`."""
        return self.requests.make_request(request_id, prompt_token_ids, params, priority,
                                          kv=kv, presampled=presampled, grammar=grammar,
                                          lora=lora)

    @property
    def requests(self) -> RequestFactory:
        """Validates and builds requests for this engine (any thread)."""
        return self.core.requests

    @property
    def lora_registry(self) -> AdapterRegistry | None:
        """The LoRA adapters the engine serves (any thread); None without LoRA."""
        lora = self.core.runner.lora
        return None if lora is None else lora.registry

    async def compile_grammar(self, structured: StructuredOutput | None
                              ) -> CompiledGrammar | None:
        """`structured` compiled on one of GRAMMAR_THREADS threads (neither the event loop
        nor the engine thread, and no lock another request needs), for `make_request`.
        Raises InvalidRequestError for a spec that does not compile, or not within the
        limit (`StructuredOutputs.compile_timeout_s`, counted from now)."""
        if structured is None:
            return None
        outputs = self.requests.structured
        work = asyncio.get_running_loop().run_in_executor(
            self._grammar_pool, outputs.compile, structured)
        try:
            return await asyncio.wait_for(work, outputs.compile_timeout_s)
        except TimeoutError:  # the thread finishes on its own; its result is dropped
            raise InvalidRequestError(outputs.timeout_message(structured.kind)) from None
        except GrammarCompileError as err:
            raise InvalidRequestError(str(err)) from None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, *, kv: KVHandoff | None = None) -> asyncio.Queue:
        """Validate (raises InvalidRequestError / ValueError) and queue one request; returns
        the queue its EngineOutputs arrive on (read it with `stream`)."""
        return self.submit(self.make_request(request_id, prompt_token_ids, params, priority,
                                             kv=kv))

    def submit(self, req: Request) -> asyncio.Queue:
        """Queue a request already built (and validated) by `core.make_request`."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}")
        if req.request_id in self._streams:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        self.start()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = (asyncio.get_running_loop(), stream)
        self._num_sent += 1
        self._enqueue("add", req)
        return stream

    def call_soon(self, fn) -> None:
        """Run `fn()` on the engine thread between steps (live tuning)."""
        self._enqueue("call", fn)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._enqueue("abort", request_id)

    def _enqueue(self, kind: str, arg) -> None:
        """A command for the engine loop: "add" a request, "abort" a request id, "call" a
        function between steps."""
        self._commands.put((kind, arg))

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs (with the latest delta) for one request, vLLM's shape;
        n > 1 is the caller's to fan out. Leaving the loop early (or being cancelled)
        aborts it."""
        queue = self.add_request(request_id, prompt_token_ids, params, priority)
        result = RequestOutput(request_id, None, list(prompt_token_ids), [CompletionOutput(0)])
        async for batch in self.stream(request_id, queue):
            result.outputs[0].add(batch)
            last = batch[-1]
            result.num_cached_tokens = last.num_cached_tokens or result.num_cached_tokens
            result.kv_transfer_params = last.kv_transfer_params
            for out in batch:
                if out.queue_time is not None:
                    result.queue_time, result.kv_transfer_time = (out.queue_time,
                                                                  out.kv_transfer_time)
            yield result

    async def stream(self, request_id: str, queue: asyncio.Queue
                     ) -> AsyncIterator[list[EngineOutput]]:
        """The outputs of a submitted request, in batches of what arrived together; the
        last batch ends with its finished output. Raises EngineDeadError if the loop dies.
        Leaving early (or being cancelled) aborts the request."""
        finished = False
        try:
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                if isinstance(batch[-1], _Failure):
                    raise EngineDeadError(f"the engine loop died: {batch[-1].error!r}")
                finished = batch[-1].finished
                yield batch
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def _deliver(self, outputs: list[EngineOutput | _Failure]) -> None:
        """Runs on the event loop that owns these streams."""
        for o in outputs:
            entry = self._streams.get(o.request_id)
            if entry is None:
                continue
            entry[1].put_nowait(o)
            if isinstance(o, _Failure) or o.finished:
                self._streams.pop(o.request_id, None)

    def _post(self, outputs: Sequence[EngineOutput | _Failure]) -> None:
        """From the engine thread: hand outputs to the loop(s) reading them, one callback
        per loop. A closed loop's readers are gone; their outputs are dropped."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for o in outputs:
            entry = self._streams.get(o.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append(o)
        for loop, outs in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, outs)
            except RuntimeError:  # loop closed
                for o in outs:
                    self._streams.pop(o.request_id, None)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        name_os_thread(ENGINE_THREAD_NAME)
        try:
            while not self._stopping:
                busy = core.has_unfinished_requests()
                collecting = core.idle_for() if busy else 0.0
                # Idle but with pulls or leases to advance: wake up now and then to poll;
                # collecting a dynamic batch: until its window closes or a request arrives.
                self._apply_commands(block=not busy or collecting > 0,
                                     timeout=collecting or (0.01 if core.needs_polling
                                                            else None))
                if self._stopping:
                    break
                if core.has_unfinished_requests() or core.needs_polling:
                    outputs = core.step()
                    if outputs:
                        self._post(outputs)
        except BaseException as err:  # noqa: BLE001 - every stream must hear about it
            log.exception("engine loop crashed")
            self._died(err)
        finally:
            core.close()

    def _died(self, err: BaseException) -> None:
        """The loop crashed: every stream in flight fails with `err`."""
        self.dead_error = err
        self._post([_Failure(rid, err) for rid in list(self._streams)])

    def _apply_commands(self, block: bool, timeout: float | None = None) -> None:
        outputs: list[EngineOutput] = []
        while True:
            try:
                kind, arg = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            block = False
            if kind == "stop":
                self._stopping = True
                break
            if kind == "add":
                outputs.extend(self._add(arg))
            elif kind == "abort":
                outputs.extend(self.core.abort_requests([arg]))
            elif kind == "call":
                arg()
        if outputs:
            self._post(outputs)

    def _add(self, req: Request) -> list[EngineOutput]:
        try:
            return self.core.add(req)
        except ValueError as err:  # duplicate id raced in; fail that request only
            return [EngineOutput(req.request_id, [], "", None, finish_reason="abort",
                                 stop_reason=str(err))]
        finally:
            self._num_applied += 1


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: /proc/<pid>/task/<tid>/comm, at most
    15 bytes), so profilers and `serving_bench` tell the engine thread from the event loop
    and torch's workers. Best effort: a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _raising(err: BaseException):
    def fn() -> None:
        raise err

    return fn
