"""The engine side of serving: one HTTP request's engine jobs, their admission, their output.

One HTTP request becomes `len(prompts) * n` engine requests, the `Job`s (ids
`<id>-<choice>`). `Serving.make_jobs` validates them all, `admit` queues all or none (429
when the waiting queue is full), and `run` merges their engine output batches into one
stream of `Update`s `(job, batch)`, recording the request metrics (TTFT, inter-token
latency, end-to-end, queue time, finish reasons) on the way. That stream is this module's
whole interface to the formatting (`openai_api`): it never calls back here.

Leaving `run` early (client gone, error) cancels every engine request of it, which frees
their KV blocks; `abort` does the same for jobs that never ran.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from baton.common.errors import NO_RETRY_HEADER, OpenAIError
from baton.common.internal import KVTransferParams
from baton.common.metrics import WorkerMetrics
from baton.common.sampling_params import SamplingParams, StructuredOutput, child_params
from baton.engine.async_engine import AsyncEngine, EngineDeadError
from baton.engine.context_window import check_context
from baton.engine.errors import InvalidRequestError
from baton.engine.kv_connector import KVHandoff
from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.lora.stats import LoRACounters
from baton.engine.outputs import EngineOutput
from baton.engine.request import Request
from baton.engine.structured.base import CompiledGrammar
from baton.worker.fair_share import DEFAULT_TENANT, FairShare


@dataclass(frozen=True)
class FirstToken:
    """This worker's part of a job's TTFT, taken when its first token arrived."""

    worker_s: float  # arrival on this worker -> first token
    queue_s: float | None  # arrival -> first scheduled, as the engine reported it


@dataclass
class Job:
    """One engine request of an HTTP request, and what its outputs told so far (written
    by `Serving.run` before each update is handed on)."""

    index: int  # the choice it answers: prompt * n + sample
    request_id: str
    prompt_ids: list[int]
    request: Request  # built and validated by make_jobs, queued by admit
    stream: asyncio.Queue | None = None  # set once queued in the engine
    arrival: float = 0.0
    first_token: FirstToken | None = None
    queue_s: float | None = None
    kv_transfer_s: float | None = None  # decode role: the KV pull, if there was one
    kv_transfer_params: KVTransferParams | None = None  # prefill role: the KV it holds
    finish_reason: str | None = None
    last_token_at: float | None = None


# One batch of a job's engine outputs, in the order they arrived.
Update = tuple[Job, list[EngineOutput]]


class Serving:
    def __init__(self, engine: AsyncEngine, metrics: WorkerMetrics, max_waiting: int,
                 lora_counters: LoRACounters | None = None) -> None:
        """`lora_counters`: where tokens of LoRA adapters' requests are counted."""
        self.engine = engine
        self.metrics = metrics
        self.lora_counters = lora_counters
        self.max_waiting = max_waiting
        self.max_model_len = engine.max_model_len
        self.fair_share = FairShare(max_waiting)

    # -- before the engine -----------------------------------------------------------------
    def make_jobs(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  param: str, *, kv: KVHandoff | None = None, presampled: int = 0,
                  priority: int = 0, grammar: CompiledGrammar | None = None,
                  lora: LoRAAdapter | None = None) -> list[Job]:
        """Validate every prompt against the context window and build one job per prompt
        and sample (`kv` / `presampled` / `priority` / `grammar` / `lora`: see
        `AsyncEngine.make_request`; `grammar` from `compile_grammar`).
        Raises a 400 OpenAIError naming `param` for a bad prompt; nothing is queued yet."""
        try:
            for ids in prompts:  # every prompt before any job is made
                check_context(len(ids), params.max_tokens, self.max_model_len)
            return self._make_jobs(request_id, prompts, params, priority, kv, presampled,
                                   grammar, lora)
        except InvalidRequestError as err:
            raise OpenAIError(400, str(err), param=err.param or param, code=err.code) from None

    async def compile_grammar(self, structured: StructuredOutput | None, param: str
                              ) -> CompiledGrammar | None:
        """The request's output constraint compiled off the event loop and off the engine
        thread; a 400 OpenAIError naming `param` (the field that asked for it) when it does
        not compile, or not in time."""
        try:
            return await self.engine.compile_grammar(structured)
        except InvalidRequestError as err:
            raise OpenAIError(400, str(err), param=param) from None

    def _make_jobs(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                   priority: int, kv: KVHandoff | None, presampled: int,
                   grammar: CompiledGrammar | None, lora: LoRAAdapter | None) -> list[Job]:
        children = child_params(params)
        jobs = []
        for p, ids in enumerate(prompts):
            for i, child in enumerate(children):
                index = p * len(children) + i
                rid = f"{request_id}-{index}"
                req = self.engine.make_request(rid, ids, child, priority, kv=kv,
                                               presampled=presampled, grammar=grammar,
                                               lora=lora)
                jobs.append(Job(index, rid, ids, req))
        return jobs

    def admit(self, jobs: list[Job], tenant: str = DEFAULT_TENANT) -> None:
        """Queue all jobs in the engine, or none of them: 503 when the engine died, 429 when
        the waiting queue is full — unless `tenant` is within its fair share of it while
        another tenant fills it (`fair_share.py`). No await between the check and the adds,
        so concurrent handlers cannot overfill it."""
        if self.engine.dead_error is not None:
            raise OpenAIError(503, "the engine loop died; this worker is restarting",
                              code="engine_dead")
        if len(jobs) > self.max_waiting:  # no wait would ever let it in: not a 429
            raise OpenAIError(400, f"the request makes {len(jobs)} sequences (prompts x n) "
                                   f"but this worker queues at most {self.max_waiting}; send "
                                   "fewer prompts or a smaller n",
                              code="too_many_sequences")
        waiting = self.engine.num_waiting
        if (waiting + len(jobs) > self.max_waiting
                and not self.fair_share.within_share(tenant, len(jobs))):
            self.metrics.rejected.labels("queue_full").inc()
            raise OpenAIError(429, f"the waiting queue is full ({waiting} of "
                                   f"{self.max_waiting}); retry later", code="queue_full",
                              headers={"Retry-After": "1"})
        try:
            for job in jobs:
                job.arrival = time.monotonic()
                job.stream = self.engine.submit(job.request)
        except Exception:
            self.abort(jobs)
            raise
        self.fair_share.add(tenant, jobs)

    def abort(self, jobs: list[Job]) -> None:
        """Abort whatever of these jobs is still running (a no-op for finished ones)."""
        for job in jobs:
            self.engine.abort(job.request_id)

    # -- running ---------------------------------------------------------------------------
    def run(self, jobs: list[Job]) -> AsyncIterator[Update]:
        """The admitted jobs' output batches, merged in arrival order (one job's own, no
        layer in between). Raises EngineDeadError if the engine loop dies; leaving early
        aborts every job."""
        return self._updates(jobs[0]) if len(jobs) == 1 else self._merged(jobs)

    async def _merged(self, jobs: list[Job]) -> AsyncIterator[Update]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: Job) -> None:
            try:
                async for update in self._updates(job):
                    queue.put_nowait(update)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(err)
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _updates(self, job: Job) -> AsyncIterator[Update]:
        try:
            assert job.stream is not None  # run() takes admitted jobs: admit() set it
            async for batch in self.engine.stream(job.request_id, job.stream):
                self._record(job, batch, time.monotonic())
                if batch[-1].finish_reason == "error":
                    raise RequestFailedError(str(batch[-1].stop_reason))
                yield job, batch
        finally:
            if job.finish_reason is None:  # client gone or engine error: the engine aborts it
                self.metrics.requests.labels("abort").inc()

    def _record(self, job: Job, batch: list[EngineOutput], now: float) -> None:
        """Fold one batch into the job and the metrics. Tokens that arrived together count
        one inter-token gap and a zero for each other token."""
        m = self.metrics
        for out in batch:
            if out.queue_time is not None:
                job.queue_s, job.kv_transfer_s = out.queue_time, out.kv_transfer_time
            if out.kv_transfer_params is not None:
                job.kv_transfer_params = out.kv_transfer_params
        num_tokens = sum(len(out.new_token_ids) for out in batch)
        if num_tokens:
            if job.last_token_at is None:
                m.ttft.observe(now - job.arrival)
                job.first_token = FirstToken(now - job.arrival, job.queue_s)
            else:
                m.itl.observe(now - job.last_token_at)
                for _ in range(num_tokens - 1):
                    m.itl.observe(0.0)
            job.last_token_at = now
        finish = batch[-1].finish_reason
        self._count_lora_tokens(job, num_tokens, finish is not None)
        if finish is not None:
            job.finish_reason = finish
            m.e2e.observe(now - job.arrival)
            m.requests.labels(finish).inc()
            if job.queue_s is not None:
                m.queue_time.observe(job.queue_s)


    def _count_lora_tokens(self, job: Job, generated: int, finished: bool) -> None:
        if self.lora_counters is None or job.request.lora is None:
            return
        lora = job.request.lora
        if generated:
            self.lora_counters.count("generation_tokens", lora.name, generated)
        if finished:
            self.lora_counters.count("prompt_tokens", lora.name, len(job.prompt_ids))


class RequestFailedError(RuntimeError):
    """The engine ended one request with an error its own settings caused (the engine and
    every other request go on). Another worker would fail it the same way."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(err: BaseException) -> OpenAIError:
    """What a failure while running jobs becomes at the HTTP edge: 503 when the engine loop
    died (this worker restarts), a final 500 when the request's own settings failed it,
    else a 500 naming the error."""
    if isinstance(err, EngineDeadError):
        return OpenAIError(503, str(err), code="engine_dead")
    if isinstance(err, RequestFailedError):
        return OpenAIError(500, f"the engine could not serve this request: {err}",
                           code="request_failed", headers={NO_RETRY_HEADER: "1"})
    return OpenAIError(500, f"internal error: {err!r}")
