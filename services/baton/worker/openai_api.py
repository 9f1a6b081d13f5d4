"""Response bodies of /v1/chat/completions and /v1/completions, streamed (SSE) or whole.

An error after the stream has started cannot change the status code any more: it is sent as
one `data: {"error": ...}` event followed by `data: [DONE]`, as vLLM does (`_framed`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.worker.serving import SSE_DONE, Job, OpenAIServing, engine_error, sse, usage


class _Tally:
    """Per-choice accumulation shared by both endpoints."""

    def __init__(self, n: int) -> None:
        self.text = [""] * n
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.tokens = [0] * n
        self.cached = 0

    def add(self, d) -> None:
        self.text[d.index] += d.text
        self.tokens[d.index] += len(d.token_ids)
        if d.logprobs:
            self.logprobs[d.index].extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason
            self.cached = max(self.cached, d.num_cached_tokens)


async def chat(serving: OpenAIServing, req: ChatCompletionRequest, jobs: list[Job],
               response_id: str) -> dict | AsyncIterator[bytes]:
    prompt_tokens = len(jobs[0].prompt_ids)
    created = int(time.time())
    if req.stream:
        base = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                "model": serving.model_name}
        tally = _Tally(len(jobs))
        return _framed(_chat_chunks(serving, req, jobs, base, tally), req, base, tally,
                       prompt_tokens)
    tally = _Tally(len(jobs))
    async for d in serving.run(jobs):
        tally.add(d)
    choices = [{"index": i, "message": {"role": "assistant", "content": tally.text[i]},
                "logprobs": serving.chat_logprobs(tally.logprobs[i]) if req.logprobs else None,
                "finish_reason": tally.finish[i]} for i in range(len(jobs))]
    return {"id": response_id, "object": "chat.completion", "created": created,
            "model": serving.model_name, "choices": choices,
            "usage": usage(prompt_tokens, sum(tally.tokens), tally.cached)}


async def _framed(chunks: AsyncIterator[bytes], req, base: dict, tally: _Tally,
                  prompt_tokens: int) -> AsyncIterator[bytes]:
    """The SSE stream around the content chunks: the usage chunk when asked for, an error
    as an event (the status line is gone by then), and `[DONE]`."""
    try:
        async for chunk in chunks:
            yield chunk
        if req.include_usage:
            yield sse(base | {"choices": [], "usage": usage(prompt_tokens, sum(tally.tokens),
                                                            tally.cached)})
    except Exception as err:  # noqa: BLE001 - reported in-band
        yield sse(engine_error(err).body())
    yield SSE_DONE


async def _chat_chunks(serving: OpenAIServing, req: ChatCompletionRequest, jobs: list[Job],
                       base: dict, tally: _Tally) -> AsyncIterator[bytes]:
    for job in jobs:
        yield sse(base | {"choices": [{"index": job.index, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
    async for d in serving.run(jobs):
        tally.add(d)
        if not d.text and d.finish_reason is None and not (req.logprobs and d.logprobs):
            continue
        lps = serving.chat_logprobs(d.logprobs or []) if req.logprobs else None
        yield sse(base | {"choices": [{"index": d.index, "delta": {"content": d.text},
                                       "logprobs": lps, "finish_reason": d.finish_reason}]})


async def completion(serving: OpenAIServing, req: CompletionRequest, jobs: list[Job],
                     prompts: list[list[int]], response_id: str) -> dict | AsyncIterator[bytes]:
    created = int(time.time())
    prompt_tokens = sum(len(p) for p in prompts)
    per_prompt = len(jobs) // len(prompts)
    echo = [_echo_text(serving, req, prompts, job.index // per_prompt) for job in jobs]
    if req.stream:
        base = {"id": response_id, "object": "text_completion", "created": created,
                "model": serving.model_name}
        tally = _Tally(len(jobs))
        return _framed(_completion_chunks(serving, req, jobs, echo, base, tally), req, base,
                       tally, prompt_tokens)
    tally = _Tally(len(jobs))
    async for d in serving.run(jobs):
        tally.add(d)
    choices = []
    for i in range(len(jobs)):
        lps = (serving.completion_logprobs(tally.logprobs[i], len(echo[i]))
               if req.logprobs is not None else None)
        choices.append({"index": i, "text": echo[i] + tally.text[i], "logprobs": lps,
                        "finish_reason": tally.finish[i]})
    return {"id": response_id, "object": "text_completion", "created": created,
            "model": serving.model_name, "choices": choices,
            "usage": usage(prompt_tokens, sum(tally.tokens), tally.cached)}


def _echo_text(serving: OpenAIServing, req: CompletionRequest, prompts, p: int) -> str:
    if not req.echo:
        return ""
    original = req.prompts()[p]
    return original if isinstance(original, str) else serving.tokenizer.decode(prompts[p])


async def _completion_chunks(serving: OpenAIServing, req: CompletionRequest, jobs: list[Job],
                             echo: list[str], base: dict, tally: _Tally
                             ) -> AsyncIterator[bytes]:
    offsets = [len(e) for e in echo]
    for job in jobs:
        if echo[job.index]:
            yield sse(base | {"choices": [{"index": job.index, "text": echo[job.index],
                                           "logprobs": None, "finish_reason": None}]})
    async for d in serving.run(jobs):
        tally.add(d)
        if not d.text and d.finish_reason is None and not (req.logprobs is not None
                                                            and d.logprobs):
            continue
        lps = None
        if req.logprobs is not None:
            lps = serving.completion_logprobs(d.logprobs or [], offsets[d.index])
        offsets[d.index] += len(d.text)
        yield sse(base | {"choices": [{"index": d.index, "text": d.text, "logprobs": lps,
                                       "finish_reason": d.finish_reason}]})
