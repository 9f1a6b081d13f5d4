"""Response bodies of /v1/chat/completions and /v1/completions, streamed (SSE) or whole.

An error after the stream has started cannot change the status code any more: it is sent as
one `data: {"error": ...}` event followed by `data: [DONE]`, as vLLM does (`_framed`).

`Internal` carries what only a router asks for on a decode pod's /internal/generate: token
ids in every streamed chunk (so the router can resume the stream elsewhere if this pod
dies), and a resumption's bookkeeping (the original prompt and tokens already sent, so the
usage, ids and offsets continue the interrupted stream instead of starting a new one).
It also carries `timing`, the router's part of a request's TTFT, when the client asked for
a TTFT breakdown (header `X-Baton-Timing`): the response then has `baton_ttft` (seconds:
router queue, prefill, decode queue, first token, and their sum `total_s`; plus the KV
pull `transfer_s`, which is off the TTFT path: a decode pod streams the prefill's first
token before it pulls) at the top level of a whole response, or on a stream's last event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.worker.serving import SSE_DONE, Job, OpenAIServing, engine_error, sse, usage


@dataclass(frozen=True)
class Internal:
    return_token_ids: bool = False
    resumed_prompt_tokens: int | None = None  # the original prompt's length
    resumed_completion_tokens: int = 0  # tokens the client already has
    resumed_text_offset: int = 0  # characters the client already has (completion logprobs)
    created: int | None = None
    timing: dict | None = None  # the router's part of the TTFT; None: no breakdown asked

    @property
    def resumed(self) -> bool:
        return self.resumed_prompt_tokens is not None

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        if self.resumed:
            return usage(self.resumed_prompt_tokens,
                         completion_tokens + self.resumed_completion_tokens, cached)
        return usage(prompt_tokens, completion_tokens, cached)


PUBLIC = Internal()


def ttft_breakdown(router: dict, worker: dict, transfer: float | None) -> dict:
    queue = worker.get("queue_s") or 0.0
    parts = {"router_queue_s": router.get("router_queue", 0.0),
             "prefill_s": router.get("prefill", 0.0), "decode_queue_s": queue,
             "first_token_s": max(worker["worker_s"] - queue, 0.0)}
    parts["total_s"] = sum(parts.values())
    parts["transfer_s"] = transfer or 0.0
    return {k: round(v, 6) for k, v in parts.items()}


class _Tally:
    """Per-choice accumulation shared by both endpoints."""

    def __init__(self, n: int) -> None:
        self.text = [""] * n
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.tokens = [0] * n
        self.cached = 0
        self.ttft: dict | None = None
        self.kv_transfer_s: float | None = None

    def add(self, d) -> None:
        if d.ttft is not None and self.ttft is None:
            self.ttft = d.ttft
        if d.kv_transfer_s is not None:
            self.kv_transfer_s = d.kv_transfer_s
        self.text[d.index] += d.text
        self.tokens[d.index] += len(d.token_ids)
        if d.logprobs:
            self.logprobs[d.index].extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
            self.cached = max(self.cached, d.num_cached_tokens)


async def chat(serving: OpenAIServing, req: ChatCompletionRequest, jobs: list[Job],
               response_id: str, internal: Internal = PUBLIC) -> dict | AsyncIterator[bytes]:
    prompt_tokens = len(jobs[0].prompt_ids)
    created = internal.created or int(time.time())
    if req.stream:
        base = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                "model": serving.model_name}
        tally = _Tally(len(jobs))
        return _framed(_chat_chunks(serving, req, jobs, base, tally, internal), req, base,
                       tally, prompt_tokens, internal)
    tally = _Tally(len(jobs))
    async for d in serving.run(jobs):
        tally.add(d)
    choices = [{"index": i, "message": {"role": "assistant", "content": tally.text[i]},
                "logprobs": serving.chat_logprobs(tally.logprobs[i]) if req.logprobs else None,
                "finish_reason": tally.finish[i]} for i in range(len(jobs))]
    return _timed({"id": response_id, "object": "chat.completion", "created": created,
                   "model": serving.model_name, "choices": choices,
                   "usage": usage(prompt_tokens, sum(tally.tokens), tally.cached)},
                  internal, tally)


async def _framed(chunks: AsyncIterator[bytes], req, base: dict, tally: _Tally,
                  prompt_tokens: int, internal: Internal) -> AsyncIterator[bytes]:
    """The SSE stream around the content chunks: the usage chunk when asked for, an error
    as an event (the status line is gone by then), and `[DONE]`."""
    try:
        async for chunk in chunks:
            yield chunk
        if req.include_usage:
            yield sse(base | {"choices": [], "usage": internal.usage(
                prompt_tokens, sum(tally.tokens), tally.cached)})
    except Exception as err:  # noqa: BLE001 - reported in-band
        yield sse(engine_error(err).body())
    yield SSE_DONE


async def _chat_chunks(serving: OpenAIServing, req: ChatCompletionRequest, jobs: list[Job],
                       base: dict, tally: _Tally, internal: Internal) -> AsyncIterator[bytes]:
    if not internal.resumed:  # a resumed stream's client has its role chunk already
        for job in jobs:
            first = base | {"choices": [{"index": job.index, "delta": {
                "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            if internal.return_token_ids:
                first["prompt_token_ids"] = job.prompt_ids
            yield sse(first)
    ids = internal.return_token_ids
    async for d in serving.run(jobs):
        tally.add(d)
        if not (d.text or d.finish_reason is not None or (req.logprobs and d.logprobs)
                or (ids and d.token_ids)):
            continue
        lps = serving.chat_logprobs(d.logprobs or []) if req.logprobs else None
        choice = {"index": d.index, "delta": {"content": d.text}, "logprobs": lps,
                  "finish_reason": d.finish_reason}
        if ids:
            choice["token_ids"] = d.token_ids
        event = base | {"choices": [choice]}
        yield sse(_timed(event, internal, tally) if d.finish_reason is not None else event)


async def completion(serving: OpenAIServing, req: CompletionRequest, jobs: list[Job],
                     prompts: list[list[int]], response_id: str, internal: Internal = PUBLIC
                     ) -> dict | AsyncIterator[bytes]:
    created = internal.created or int(time.time())
    prompt_tokens = sum(len(p) for p in prompts)
    per_prompt = len(jobs) // len(prompts)
    echo = [_echo_text(serving, req, prompts, job.index // per_prompt) for job in jobs]
    if req.stream:
        base = {"id": response_id, "object": "text_completion", "created": created,
                "model": serving.model_name}
        tally = _Tally(len(jobs))
        return _framed(_completion_chunks(serving, req, jobs, echo, base, tally, internal),
                       req, base, tally, prompt_tokens, internal)
    tally = _Tally(len(jobs))
    async for d in serving.run(jobs):
        tally.add(d)
    choices = []
    for i in range(len(jobs)):
        lps = (serving.completion_logprobs(tally.logprobs[i], len(echo[i]))
               if req.logprobs is not None else None)
        choices.append({"index": i, "text": echo[i] + tally.text[i], "logprobs": lps,
                        "finish_reason": tally.finish[i]})
    return _timed({"id": response_id, "object": "text_completion", "created": created,
                   "model": serving.model_name, "choices": choices,
                   "usage": usage(prompt_tokens, sum(tally.tokens), tally.cached)},
                  internal, tally)


def _timed(event: dict, internal: Internal, tally: _Tally) -> dict:
    if internal.timing is not None and tally.ttft is not None:
        event["baton_ttft"] = ttft_breakdown(internal.timing, tally.ttft, tally.kv_transfer_s)
    return event


def _echo_text(serving: OpenAIServing, req: CompletionRequest, prompts, p: int) -> str:
    if not req.echo:
        return ""
    original = req.prompts()[p]
    return original if isinstance(original, str) else serving.tokenizer.decode(prompts[p])


async def _completion_chunks(serving: OpenAIServing, req: CompletionRequest, jobs: list[Job],
                             echo: list[str], base: dict, tally: _Tally, internal: Internal
                             ) -> AsyncIterator[bytes]:
    offsets = [len(e) + internal.resumed_text_offset for e in echo]
    ids = internal.return_token_ids
    for job in jobs:
        if echo[job.index] or (ids and not internal.resumed):
            first = base | {"choices": [{"index": job.index, "text": echo[job.index],
                                         "logprobs": None, "finish_reason": None}]}
            if ids:
                first["prompt_token_ids"] = job.prompt_ids
            yield sse(first)
    async for d in serving.run(jobs):
        tally.add(d)
        if not (d.text or d.finish_reason is not None
                or (req.logprobs is not None and d.logprobs) or (ids and d.token_ids)):
            continue
        lps = None
        if req.logprobs is not None:
            lps = serving.completion_logprobs(d.logprobs or [], offsets[d.index])
        offsets[d.index] += len(d.text)
        choice = {"index": d.index, "text": d.text, "logprobs": lps,
                  "finish_reason": d.finish_reason}
        if ids:
            choice["token_ids"] = d.token_ids
        event = base | {"choices": [choice]}
        yield sse(_timed(event, internal, tally) if d.finish_reason is not None else event)
