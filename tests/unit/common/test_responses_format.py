"""Chat answers turned into Responses answers: the whole Response, and the stream's event
sequence, checked against the official SDK's own stream assembly and parsing."""

from __future__ import annotations

import json

from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from baton.common.errors import OpenAIError
from baton.common.protocol import parse_request
from baton.common.responses_api import ResponsesRequest
from baton.common.responses_format import ResponsesFormat

HEADER = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
         "prompt_tokens_details": {"cached_tokens": 2}}


def make_format(**body) -> ResponsesFormat:
    return ResponsesFormat(parse_request(ResponsesRequest, json.dumps(
        {"model": "m", "input": "hi"} | body).encode()))


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None
          ) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]
    event = HEADER | {"choices": choices} | ({"usage": usage} if usage else {})
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def call(index: int, name: str | None = None, args: str = "", call_id: str | None = None
         ) -> dict:
    part: dict = {"index": index, "function": {"arguments": args}}
    if name is not None:
        part |= {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": args}}
    return {"tool_calls": [part]}


TEXT_STREAM = (chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hel"})
               + chunk({"content": "lo"}) + chunk({}, "stop") + chunk(usage=USAGE)
               + b"data: [DONE]\n\n")
CALL_STREAM = (chunk({"role": "assistant", "content": ""}) + chunk({"content": "Sure. "})
               + chunk(call(0, "get_weather", call_id="call_a"))
               + chunk(call(0, args='{"city": ')) + chunk(call(0, args='"Paris"}'))
               + chunk(call(1, "get_time", '{"zone": "CET"}', "call_b"))
               + chunk({}, "tool_calls") + chunk(usage=USAGE) + b"data: [DONE]\n\n")


def events(sse: bytes) -> list[dict]:
    out = []
    for block in sse.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n")
            event = json.loads(data.removeprefix(b"data: "))
            assert head == b"event: " + event["type"].encode()
            out.append(event)
    return out


def feed_in_pieces(fmt: ResponsesFormat, stream: bytes, size: int = 7) -> bytes:
    return b"".join(fmt.feed(stream[i:i + size]) for i in range(0, len(stream), size))


def assembled(sse: bytes, **state):
    """What the SDK's stream helper (`client.responses.stream`) makes of the events."""
    helper = ResponseStreamState(input_tools=state.get("tools", omit),
                                 text_format=state.get("text_format", omit))
    for event in events(sse):
        helper.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return helper._completed_response


def test_a_text_stream_is_the_responses_event_sequence():
    fmt = make_format(stream=True)
    out = events(feed_in_pieces(fmt, TEXT_STREAM))  # chat events cut anywhere
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    assert [e["delta"] for e in out if e["type"].endswith("text.delta")] == ["Hel", "lo"]
    final = out[-1]["response"]
    assert final["status"] == "completed" and final["id"] == out[0]["response"]["id"]
    assert final["usage"] == {"input_tokens": 9, "output_tokens": 4, "total_tokens": 13,
                              "input_tokens_details": {"cached_tokens": 2,
                                                       "cache_write_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}
    response = assembled(feed_in_pieces(make_format(stream=True), TEXT_STREAM))
    assert response.output_text == "Hello" and response.usage.output_tokens == 4
    assert fmt.done and fmt.response.output_text == "Hello"


def test_a_stream_with_calls_has_function_call_items():
    sse = make_format(stream=True).feed(CALL_STREAM)
    out = events(sse)
    kinds = [e["type"] for e in out]
    assert kinds[kinds.index("response.output_item.done") + 1:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = [e for e in out if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
    response = assembled(sse)
    assert response.output_text == "Sure. "
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_time", {"zone": "CET"})]
    assert all(c.status == "completed" for c in calls)


def test_the_whole_answer_is_the_stream_s_final_response():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
            "usage": USAGE, "choices": [{"index": 0, "finish_reason": "tool_calls",
                                         "logprobs": None, "message": {
                "role": "assistant", "content": "Sure. ", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}]}
    whole = make_format(metadata={"k": "v"}).whole(json.dumps(body).encode()).dump()
    streamed = events(make_format(stream=True).feed(CALL_STREAM))[-1]["response"]
    sdk = Response.model_validate(whole)  # the SDK's own type takes it
    assert sdk.output_text == "Sure. " and sdk.metadata == {"k": "v"}
    assert [i["type"] for i in whole["output"]] == ["message", "function_call"]
    assert whole["output"][1]["call_id"] == "call_a" and whole["usage"] == streamed["usage"]
    assert (whole["status"], whole["object"], whole["tool_choice"]) == (
        "completed", "response", "none")
    assert whole["id"].startswith("resp_") and whole["output"][0]["id"].startswith("msg_")


def test_max_output_tokens_makes_an_incomplete_response():
    stream = chunk({"content": "abc"}) + chunk({}, "length") + chunk(usage=USAGE) \
        + b"data: [DONE]\n\n"
    out = events(make_format(stream=True, max_output_tokens=4).feed(stream))
    final = out[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["max_output_tokens"] == 4
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_errors_end_the_stream_with_an_error_event_and_response_failed():
    error = b'data: {"error": {"message": "engine died", "type": "internal_server_error", ' \
        b'"param": null, "code": null}}\n\n'
    out = events(make_format(stream=True).feed(chunk({"content": "a"}) + error
                                               + b"data: [DONE]\n\n"))
    assert [e["type"] for e in out[-2:]] == ["error", "response.failed"]
    assert out[-2]["message"] == "engine died"
    assert out[-1]["response"]["status"] == "failed"
    assert out[-1]["response"]["error"]["message"] == "engine died"

    fmt = make_format(stream=True)
    fmt.feed(chunk({"content": "a"}))  # the relay's stream breaks here
    out = events(fmt.failed(OpenAIError(502, "the worker failed mid-stream",
                                        code="upstream_failed")))
    assert [e["type"] for e in out] == ["error", "response.failed"]
    assert out[0]["code"] == "upstream_failed" and fmt.response.status == "failed"
    assert fmt.feed(b"data: [DONE]\n\n") == b""  # nothing after the end
