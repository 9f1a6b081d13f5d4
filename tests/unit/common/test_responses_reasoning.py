"""A reasoning model's thinking in the Responses API: `reasoning_content` deltas become a
`reasoning` item streamed with the reasoning events before the message (the SDK's stream
helper assembles it), whole answers get the same item, and reasoning items sent back (or
stored, for `previous_response_id`) return to the template as the assistant turn's
`reasoning_content`."""

from __future__ import annotations

import json

from openai.types.responses import Response

from baton.common.protocol import ChatCompletionRequest, parse_request
from baton.common.response_store import StoredResponse
from baton.common.responses_api import ResponsesRequest, chat_messages
from tests.unit.common.test_responses_format import (
    USAGE,
    assembled,
    call,
    chunk,
    events,
    feed_in_pieces,
    make_format,
)

THINKING_STREAM = (chunk({"role": "assistant", "content": ""})
                   + chunk({"reasoning_content": "Let me "}) + chunk({"reasoning_content": "see."})
                   + chunk({"content": "Par"}) + chunk({"content": "is."})
                   + chunk({}, "stop") + chunk(usage=USAGE) + b"data: [DONE]\n\n")


def test_thinking_streams_as_a_reasoning_item_before_the_message():
    sse = feed_in_pieces(make_format(stream=True), THINKING_STREAM)
    out = events(sse)
    assert [e["type"] for e in out][2:-1] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[6]["text"] == "Let me see." and out[8]["item"]["status"] == "completed"
    response = assembled(sse)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Let me see.")]
    assert response.output_text == "Paris."


def test_thinking_then_a_call_closes_the_reasoning_first():
    stream = (chunk({"reasoning_content": "I should call it."})
              + chunk(call(0, "get_weather", '{"city": "Paris"}', "call_a"))
              + chunk({}, "tool_calls") + b"data: [DONE]\n\n")
    response = assembled(make_format(stream=True).feed(stream))
    assert [i.type for i in response.output] == ["reasoning", "function_call"]


def test_a_whole_answer_has_the_reasoning_item_first():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
            "usage": USAGE, "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                         "message": {"role": "assistant", "content": "Paris.",
                                                     "reasoning_content": "Let me see."}}]}
    whole = make_format().whole(json.dumps(body).encode()).dump()
    sdk = Response.model_validate(whole)
    assert [i.type for i in sdk.output] == ["reasoning", "message"]
    assert sdk.output[0].content[0].text == "Let me see." and sdk.output_text == "Paris."
    assert whole["output"][0]["id"].startswith("rs_")


def test_reasoning_items_go_back_to_the_template_as_reasoning_content():
    request = parse_request(ResponsesRequest, json.dumps({"model": "m", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Call the tool."}],
         "encrypted_content": None},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Say it."}]},
        {"type": "message", "role": "assistant", "content": "Sunny."}]}).encode())
    messages = chat_messages(request.input_items())
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content":
                           "Call the tool.", "tool_calls": [{"id": "c1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{}"}}]}
    assert messages[3] == {"role": "assistant", "content": "Sunny.",
                           "reasoning_content": "Say it."}
    chat = parse_request(ChatCompletionRequest, json.dumps(request.chat_body()).encode())
    assert chat.template_messages()[3]["reasoning_content"] == "Say it."


def test_a_stored_reasoning_item_continues_the_conversation():
    fmt = make_format(stream=True)
    fmt.feed(THINKING_STREAM)
    stored = StoredResponse(response=fmt.response, input=[])
    reasoning, message = stored.conversation()
    assert reasoning.type == "reasoning" and reasoning.text == "Let me see."
    assert chat_messages([reasoning, message]) == [
        {"role": "assistant", "content": "Paris.", "reasoning_content": "Let me see."}]
    again = StoredResponse.model_validate_json(stored.to_json())
    assert again.response.output[0].type == "reasoning"
