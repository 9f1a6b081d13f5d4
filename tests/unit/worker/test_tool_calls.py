"""Tool calls through a worker (scripted engine, real HTTP app): streamed deltas in OpenAI's
shape that the `openai` client reassembles into the whole answer's `tool_calls`, forced
calls constrained by the schema, and the 400s."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from baton.common.internal import ResumeState
from baton.common.protocol import ChatCompletionRequest, parse_request
from baton.common.roles import Role
from baton.worker import openai_api
from baton.worker.app import build_app
from baton.worker.openai_api import Internal
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.worker.fakes import (
    MODEL,
    FakeEngine,
    FakeTokenizer,
    asgi_call,
    make_pipeline,
    out,
    sse_events,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "array"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
HERMES = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "days": [{"d": 1}, {"d": 2}]}}\n</tool_call>\n<tool_call>\n'
          '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


def says(text: str, piece: int = 3, finish: str = "stop"):
    """A script answering `text` a few characters per output."""
    parts = [text[i:i + piece] for i in range(0, len(text), piece)]

    def script(req):
        return [[out(req.request_id, [10 + i], text=p,
                     finish=finish if i == len(parts) - 1 else None)]
                for i, p in enumerate(parts)]
    return script


def worker(script, **pipeline):
    state = WorkerState(WorkerSettings(role=Role.BOTH))
    state.pipeline, state.engine, _ = make_pipeline(FakeEngine(script), **pipeline)
    return build_app(state.settings, state), state.engine


def chat(app, **body):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}]} | body
    code, _, raw = asyncio.run(asgi_call(app, "POST", "/v1/chat/completions", body))
    if body.get("stream") and code == 200:
        return code, [e for _, e in sse_events(raw) if e != "[DONE]"]
    return code, json.loads(raw)


def reassembled(events: list[dict]) -> ChatCompletion:
    """The stream as the openai client sees it: every chunk valid, accumulated."""
    state = ChatCompletionStreamState()
    for event in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(event))
    return state.get_final_completion()


def calls_of(message) -> list[tuple[str, str, dict]]:
    return [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or ()]


def test_auto_hermes_calls_whole_and_streamed_agree():
    app, engine = worker(says(HERMES))
    code, body = chat(app, tools=[WEATHER, TIME])
    assert code == 200
    whole = ChatCompletion.model_validate(body)
    message, choice = whole.choices[0].message, whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert message.content == "Let me look that up."
    assert [(n, a) for _, n, a in calls_of(message)] == [
        ("get_weather", {"city": "Paris", "days": [{"d": 1}, {"d": 2}]}),
        ("get_time", {"tz": "CET"})]
    assert all(i.startswith("call_") for i, _, _ in calls_of(message))
    assert engine.tokenizer.rendered[0]["tools"] == [WEATHER, TIME]

    code, events = chat(app, tools=[WEATHER, TIME], stream=True)
    streamed = reassembled(events).choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "Let me look that up."
    assert [(n, a) for _, n, a in calls_of(streamed.message)] == \
        [(n, a) for _, n, a in calls_of(message)]
    assert not any("<tool_call>" in json.dumps(e) for e in events)  # never as content


def test_streamed_call_deltas_are_openais_shape():
    app, _ = worker(says('<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'
                         "</tool_call>", piece=2))
    _, events = chat(app, tools=[TIME], stream=True)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, rest = parts[0], parts[1:]
    assert set(first) == {"index", "id", "type", "function"}
    assert first["function"] == {"name": "get_time", "arguments": ""}
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
               for p in rest)
    assert "".join(p["function"]["arguments"] for p in rest) == '{"tz": "CET"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_prose_with_tools_is_plain_content():
    text = "It is sunny in Paris.  \n"
    app, _ = worker(says(text))
    _, body = chat(app, tools=[WEATHER])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"
    _, events = chat(app, tools=[WEATHER], stream=True)
    assert reassembled(events).choices[0].message.content == text


def test_named_choice_is_constrained_and_read_as_that_call():
    app, engine = worker(says('{"tz": "UTC"}'))
    choice = {"type": "function", "function": {"name": "get_time"}}
    _, body = chat(app, tools=[WEATHER, TIME], tool_choice=choice)
    structured = engine.made[0].params.structured
    assert structured.kind == "json_schema"
    assert json.loads(structured.spec) == TIME["function"]["parameters"]
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content is None
    assert [(n, a) for _, n, a in calls_of(message)] == [("get_time", {"tz": "UTC"})]
    _, events = chat(app, tools=[WEATHER, TIME], tool_choice=choice, stream=True)
    streamed = reassembled(events).choices[0]
    assert [(n, a) for _, n, a in calls_of(streamed.message)] == [("get_time", {"tz": "UTC"})]


def test_required_reads_the_array_and_parallel_false_keeps_one_call():
    array = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
             '{"name": "get_time", "parameters": {}}]')
    app, engine = worker(says(array))
    _, body = chat(app, tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(engine.made[0].params.structured.spec)
    assert schema["type"] == "array" and "maxItems" not in schema
    assert [(n, a) for _, n, a in calls_of(ChatCompletion.model_validate(body)
                                             .choices[0].message)] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    _, events = chat(app, tools=[WEATHER, TIME], tool_choice="required",
                     parallel_tool_calls=False, stream=True)
    assert json.loads(engine.made[-1].params.structured.spec)["maxItems"] == 1
    streamed = reassembled(events).choices[0]
    assert [n for _, n, _ in calls_of(streamed.message)] == ["get_weather"]


def test_tool_choice_none_renders_tools_but_reads_nothing():
    app, engine = worker(says(HERMES))
    _, body = chat(app, tools=[WEATHER], tool_choice="none")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": HERMES}
    assert engine.tokenizer.rendered[0]["tools"] == [WEATHER]
    assert engine.made[0].params.structured is None


def test_a_call_cut_by_length_keeps_the_length_reason():
    app, _ = worker(says('<tool_call>{"name": "get_time", "arguments": {"tz": "CE',
                         finish="length"))
    _, body = chat(app, tools=[TIME])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"tz": "CE'


def test_parser_none_refuses_auto_but_serves_forced_calls():
    app, _ = worker(says('{"tz": "UTC"}'), tool_parser="none")
    code, body = chat(app, tools=[TIME])
    assert code == 400 and body["error"]["param"] == "tool_choice"
    assert "--tool-call-parser none" in body["error"]["message"]
    code, _ = chat(app, tools=[TIME], tool_choice="required")
    assert code == 200
    assert chat(app)[0] == 200  # no tools: nothing to read


def test_mistral_keeps_special_tokens_and_short_ids():
    app, engine = worker(says('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
                         tool_parser="mistral")
    _, body = chat(app, tools=[TIME])
    assert engine.made[0].params.skip_special_tokens is False
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    chat(app)
    assert engine.made[-1].params.skip_special_tokens is True  # no tools: as asked


def test_conversation_with_calls_and_results_reaches_the_template():
    app, engine = worker(says("It is sunny."))
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
    code, _ = chat(app, tools=[WEATHER], messages=messages)
    assert code == 200
    rendered = engine.tokenizer.rendered[0]["messages"]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_9"}


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [TIME], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_tool_requests_that_cannot_be_served_are_400s(extra, param):
    app, _ = worker(says("x"))
    code, body = chat(app, **extra)
    assert code == 400 and body["error"]["param"] == param


def test_a_resumed_stream_goes_on_with_the_call_it_was_in():
    """Another decode pod resumes: it reads what the first one sent (the prompt's last
    `completion_tokens` ids) first, so its stream goes on inside the same call."""
    text = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    cut = text.index('"tz"') + 4
    sent = text[:cut]

    class Tokenizer(FakeTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            return sent if ids == [10, 11] else super().decode(ids)

    pipeline, _, _ = make_pipeline(FakeEngine(says(text[cut:]), tokenizer=Tokenizer()))
    req = parse_request(ChatCompletionRequest, json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "time?"}], "tools": [TIME],
        "stream": True}).encode())
    prompts = [[1, 2, 3, 10, 11]]
    resume = ResumeState(prompt_tokens=3, completion_tokens=2)

    async def main():
        jobs = pipeline.serving.make_jobs("r", prompts, req.to_sampling_params(), "messages")
        answer = pipeline.format.answer("chat", req, "r", prompts, 1, Internal(True, resume))
        pipeline.serving.admit(jobs)
        return b"".join([c async for c in openai_api.events(
            answer, pipeline.serving.run(jobs))])

    events = [e for kind, e in sse_events(asyncio.run(main()))
              if kind == "data" and e != "[DONE]"]
    parts = [d["tool_calls"][0] for e in events for d in [e["choices"][0]["delta"]]
             if "tool_calls" in d]
    assert all(set(p) == {"index", "function"} for p in parts)  # no second header
    assert "".join(p["function"]["arguments"] for p in parts) == ': "CET"}'
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
