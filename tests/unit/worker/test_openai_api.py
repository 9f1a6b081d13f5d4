"""The worker's OpenAI formatting over a scripted engine: token events beside the content
events (one yielded chunk each), resumed streams, whole bodies, in-band errors."""

from __future__ import annotations

import asyncio
import json

from baton.common.internal import ResumeState, StreamHeader
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.engine.async_engine import EngineDeadError
from baton.worker import openai_api
from baton.worker.openai_api import Internal
from tests.unit.worker.fakes import MODEL, FakeEngine, make_pipeline, out, sse_events

PROMPT = [1, 2, 3]


def chat_request(**body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | body
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def completion_request(**body):
    body = {"model": MODEL, "prompt": PROMPT} | body
    return parse_request(CompletionRequest, json.dumps(body).encode())


def stream(api, req, script, internal=openai_api.PUBLIC, prompts=(PROMPT,)):
    """Each chunk the SSE stream yields, parsed; and the engine."""
    pipeline, engine, _ = make_pipeline(FakeEngine(script))
    serving, prompts = pipeline.serving, [list(p) for p in prompts]

    async def main():
        jobs = serving.make_jobs("r", prompts, req.to_sampling_params(), "prompt")
        answer = pipeline.format.answer(api, req, "r", prompts, len(jobs), internal)
        serving.admit(jobs)
        return [sse_events(c) async for c in openai_api.events(answer, serving.run(jobs))]
    return asyncio.run(main()), engine


def test_chat_stream_token_events_precede_their_content_in_the_same_chunk():
    script = lambda r: [[out(r.request_id, [10])], [out(r.request_id, [11], text="")],  # noqa: E731
                        [out(r.request_id, [12, 13], text="ab", finish="stop")]]
    chunks, _ = stream("chat", chat_request(stream=True), script, Internal(True))
    header, role = chunks[0]
    assert header == ("tokens", {"prompt_token_ids": PROMPT,
                                 "header": {"id": "r", "object": "chat.completion.chunk",
                                            "created": role[1]["created"], "model": MODEL}})
    assert role[1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1] == [("tokens", {"token_ids": [10], "text_chars": 4}),
                         ("data", chunks[1][1][1])]
    assert chunks[1][1][1]["choices"][0]["delta"] == {"content": "<10>"}
    assert chunks[2] == [("tokens", {"token_ids": [11]})]  # no text: no content
    tokens, last = chunks[3]
    assert tokens == ("tokens", {"token_ids": [12, 13], "text_chars": 2,
                                 "finished": True})
    assert last[1]["choices"][0] | {"delta": None} == {
        "index": 0, "delta": None, "logprobs": None, "finish_reason": "stop"}
    assert chunks[4] == [("data", "[DONE]")]
    content = [e for c in chunks for kind, e in c if kind == "data" and e != "[DONE]"]
    assert not any("token_ids" in json.dumps(e) for e in content)


def test_public_stream_has_no_token_events_and_skips_empty_deltas():
    script = lambda r: [[out(r.request_id, [10], text="")],  # noqa: E731
                        [out(r.request_id, [11], finish="length")]]
    chunks, _ = stream("completions", completion_request(stream=True), script)
    assert [kind for c in chunks for kind, _ in c] == ["data", "data"]
    assert chunks[0][0][1]["choices"] == [{"index": 0, "text": "<11>", "logprobs": None,
                                           "finish_reason": "length"}]
    assert chunks[1] == [("data", "[DONE]")]


def test_completion_stream_for_a_router_opens_with_header_then_an_empty_chunk():
    chunks, _ = stream("completions", completion_request(stream=True, max_tokens=3),
                       lambda r: [[out(r.request_id, [10], finish="length")]], Internal(True))
    (kind, header), (_, first) = chunks[0]
    assert kind == "tokens" and header["prompt_token_ids"] == PROMPT
    assert header["header"]["object"] == "text_completion"
    assert first["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                 "finish_reason": None}]


def test_completion_echo_for_a_router_is_counted_by_the_header_event():
    """A resumed stream's text offsets start after the echo the client already has."""
    req = completion_request(prompt="hello", stream=True, echo=True, max_tokens=1)
    chunks, _ = stream("completions", req, lambda r: [[out(r.request_id, [10],  # noqa: E731
                                                           finish="length")]], Internal(True))
    (kind, header), (_, first) = chunks[0]
    assert kind == "tokens" and header["text_chars"] == len("hello")
    assert first["choices"][0]["text"] == "hello"


def test_resumed_stream_continues_ids_usage_and_offsets():
    resume = ResumeState(prompt_tokens=2, completion_tokens=1, text_offset=7, created=42)
    req = completion_request(stream=True, logprobs=0, stream_options={"include_usage": True})
    script = lambda r: [[out(r.request_id, [10], finish="length", logprobs=True,  # noqa: E731
                             num_cached_tokens=2)]]
    chunks, engine = stream("completions", req, script, Internal(True, resume))
    assert chunks[0] == [("tokens", {"prompt_token_ids": PROMPT, "header": {
        "id": "r", "object": "text_completion", "created": 42, "model": MODEL}})]
    tokens, (_, content) = chunks[1]
    assert tokens[1]["token_ids"] == [10] and content["created"] == 42
    assert content["choices"][0]["logprobs"] == {
        "tokens": ["<10>"], "token_logprobs": [-0.5], "top_logprobs": [{}],
        "text_offset": [7]}
    assert chunks[2][0][1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                        "total_tokens": 4,
                                        "prompt_tokens_details": {"cached_tokens": 2}}


def test_error_after_the_stream_started_is_an_event_then_done():
    script = lambda r: [[out(r.request_id, [10])], EngineDeadError("boom")]  # noqa: E731
    chunks, engine = stream("chat", chat_request(stream=True), script)
    assert chunks[1][0][1]["choices"][0]["delta"] == {"content": "<10>"}
    assert chunks[2] == [("data", {"error": chunks[2][0][1]["error"]})]
    assert chunks[2][0][1]["error"]["code"] == "engine_dead"
    assert chunks[3] == [("data", "[DONE]")]
    assert engine.aborted == ["r-0"]


def test_whole_body_of_n_choices_over_two_prompts():
    req = completion_request(prompt=["ab", "c"], n=2, echo=True, max_tokens=2)
    pipeline, engine, _ = make_pipeline(FakeEngine(lambda r: [[out(
        r.request_id, [20, 21], finish="length", num_cached_tokens=int(r.request_id[-1]))]]))

    async def main():
        prompts = pipeline.prompts("completions", req)
        jobs = pipeline.serving.make_jobs("r", prompts, req.to_sampling_params(), "prompt")
        answer = pipeline.format.answer("completions", req, "r", prompts, len(jobs),
                                        Internal(timing={"prefill": 0.5}))
        pipeline.serving.admit(jobs)
        return await openai_api.body(answer, pipeline.serving.run(jobs))

    body = asyncio.run(main())
    assert [c["text"] for c in body["choices"]] == ["ab<20><21>"] * 2 + ["c<20><21>"] * 2
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8,
                             "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 3}}
    assert body["baton_ttft"]["prefill_s"] == 0.5
    assert body["baton_ttft"]["total_s"] >= 0.5


def test_header_is_the_stream_chunks_header():
    req = chat_request(stream=True)
    pipeline, _, _ = make_pipeline()
    answer = pipeline.format.answer("chat", req, "x", [PROMPT], 1, openai_api.PUBLIC)
    assert answer.header == StreamHeader(id="x", object="chat.completion.chunk",
                                         created=answer.header.created, model=MODEL)


def test_chat_logprobs_streamed_and_whole_keep_openais_shape():
    """Chat logprobs: `content` entries with token, logprob, bytes, top_logprobs, and
    OpenAI's `refusal: null` beside them, in a stream and in a whole body."""
    script = lambda r: [[out(r.request_id, [10], logprobs=True)],  # noqa: E731
                        [out(r.request_id, [11], logprobs=True, finish="stop")]]
    req = chat_request(stream=True, logprobs=True, top_logprobs=0)
    chunks, _ = stream("chat", req, script)
    first = [e for chunk in chunks for kind, e in chunk if kind == "data" and e != "[DONE]"][1]
    assert first["choices"][0]["logprobs"] == {"content": [
        {"token": "<10>", "logprob": -0.5, "bytes": list(b"<10>"), "top_logprobs": []}],
        "refusal": None}
    pipeline, _, _ = make_pipeline(FakeEngine(script))
    whole = chat_request(logprobs=True, top_logprobs=0)

    async def main():
        jobs = pipeline.serving.make_jobs("r", [PROMPT], whole.to_sampling_params(), "prompt")
        answer = pipeline.format.answer("chat", whole, "r", [PROMPT], len(jobs), Internal())
        pipeline.serving.admit(jobs)
        return await openai_api.body(answer, pipeline.serving.run(jobs))

    body = asyncio.run(main())
    lps = body["choices"][0]["logprobs"]
    assert [e["token"] for e in lps["content"]] == ["<10>", "<11>"] and lps["refusal"] is None
