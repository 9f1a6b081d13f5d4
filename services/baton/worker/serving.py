"""OpenAI completions and chat completions over the AsyncEngine.

One HTTP request becomes `len(prompts) * n` engine requests (ids `<id>-<choice>`); their
deltas are merged into one stream of `Delta`s, from which both the SSE chunks and the
non-streaming response are built. Leaving a stream early (client gone, error) cancels every
engine request of it, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from baton.common.errors import OpenAIError
from baton.common.metrics import WorkerMetrics
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.common.sampling_params import SamplingParams
from baton.engine.async_engine import AsyncEngine, EngineDeadError
from baton.engine.core import InvalidRequestError
from baton.engine.llm import child_params
from baton.engine.request import Request
from baton.engine.sampler import TokenLogprobs
from baton.engine.tokenizer import apply_chat_template


@dataclass
class Delta:
    """What one engine update added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    ttft: dict | None = None  # on the first token: this worker's part of the TTFT
    kv_transfer_s: float | None = None  # on the final delta: the KV pull, if there was one


@dataclass
class Job:
    """One engine request of an HTTP request."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    request: Request  # built and validated by make_jobs, queued by admit
    stream: asyncio.Queue | None = None  # set once queued in the engine
    arrival: float = 0.0


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: WorkerMetrics,
                 max_waiting: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.core.max_model_len
        self._token_text: dict[int, str] = {}

    # -- preparing a request ---------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                                   f"{self.model_name!r}", param="model", code="model_not_found")

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.as_template_dict() for m in req.messages]
        try:
            return apply_chat_template(self.tokenizer, messages, req.add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - template errors are the caller's input
            raise OpenAIError(400, f"the chat template rejected the messages: {err}",
                              param="messages") from None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        out = []
        for p in req.prompts():
            out.append(self.tokenizer.encode(p) if isinstance(p, str) else list(p))
        return out

    def make_jobs(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  param: str, kv: dict | None = None) -> list[Job]:
        """Validate every prompt against the context window, then check the waiting queue.
        Nothing is queued when anything is wrong."""
        for ids in prompts:
            n = len(ids)
            if n >= self.max_model_len:
                raise OpenAIError(400, f"this model's maximum context length is "
                                       f"{self.max_model_len} tokens, but the prompt has {n} "
                                       "tokens (and at least one output token is needed)",
                                  param=param, code="context_length_exceeded")
            if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
                raise OpenAIError(400, f"this model's maximum context length is "
                                       f"{self.max_model_len} tokens; {n} prompt tokens + "
                                       f"max_tokens {params.max_tokens} exceed it",
                                  param="max_tokens", code="context_length_exceeded")
        children = child_params(params)
        jobs = []
        for p, ids in enumerate(prompts):
            for i, child in enumerate(children):
                index = p * len(children) + i
                rid = f"{request_id}-{index}"
                try:
                    req = self.engine.core.make_request(rid, ids, child, **(kv or {}))
                except InvalidRequestError as err:
                    raise OpenAIError(400, str(err), param=param) from None
                jobs.append(Job(index, rid, ids, child, req))
        return jobs

    def admit(self, jobs: list[Job]) -> None:
        """Queue all jobs in the engine, or none of them: 429 when the waiting queue is
        full. No await between the check and the adds, so concurrent handlers cannot
        overfill it."""
        if self.engine.dead_error is not None:
            raise OpenAIError(503, "the engine loop died; this worker is restarting",
                              code="engine_dead")
        waiting = self.engine.num_waiting
        if waiting + len(jobs) > self.max_waiting:
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

    def abort(self, jobs: list[Job]) -> None:
        """Abort whatever of these jobs is still running (a no-op for finished ones)."""
        for job in jobs:
            self.engine.abort(job.request_id)

    # -- running ---------------------------------------------------------------------------
    async def run(self, jobs: list[Job]) -> AsyncIterator[Delta]:
        """Merge the deltas of all jobs; cancelling the consumer cancels every job."""
        streams = [self._deltas(job) for job in jobs]
        if len(streams) == 1:
            async for d in streams[0]:
                yield d
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(stream) -> None:
            try:
                async for d in stream:
                    queue.put_nowait(d)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(err)
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(pump(s)) for s in streams]
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

    async def _deltas(self, job: Job) -> AsyncIterator[Delta]:
        m = self.metrics
        last = None
        finished = False
        try:
            async for out in self.engine.outputs(job.request_id, job.stream, job.prompt_ids):
                c = out.outputs[0]
                now = time.monotonic()
                ttft = None
                if c.delta_token_ids:
                    if last is None:
                        m.ttft.observe(now - job.arrival)
                        ttft = {"worker_s": now - job.arrival, "queue_s": out.queue_time}
                    else:
                        m.itl.observe(now - last)
                        for _ in range(len(c.delta_token_ids) - 1):
                            m.itl.observe(0.0)
                    last = now
                if c.finish_reason is not None:
                    finished = True
                    m.e2e.observe(now - job.arrival)
                    m.requests.labels(c.finish_reason).inc()
                    if out.queue_time is not None:
                        m.queue_time.observe(out.queue_time)
                yield Delta(job.index, c.delta_text, c.delta_token_ids, c.delta_logprobs,
                            c.finish_reason, out.num_cached_tokens, out.kv_transfer_params,
                            ttft, out.kv_transfer_time if c.finish_reason else None)
        finally:
            if not finished:  # client gone or engine error: the engine aborts it
                m.requests.labels("abort").inc()

    # -- formatting ------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        def entry(tid: int, lp: float) -> dict:
            s = self.token_text(tid)
            return {"token": s, "logprob": max(lp, -9999.0), "bytes": list(s.encode())}
        return {"content": [entry(lp.token_id, lp.logprob) | {
            "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps], "refusal": None}

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            s = self.token_text(lp.token_id)
            tokens.append(s)
            values.append(max(lp.logprob, -9999.0))
            tops.append({self.token_text(t): max(v, -9999.0) for t, v in lp.top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def engine_error(err: BaseException) -> OpenAIError:
    if isinstance(err, EngineDeadError):
        return OpenAIError(503, str(err), code="engine_dead")
    return OpenAIError(500, f"internal error: {err!r}")
