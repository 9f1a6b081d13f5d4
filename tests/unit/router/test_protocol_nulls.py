"""Null is "not set" (OpenAI's spec allows null for every optional field), and a message
replayed from a response (`message.model_dump()`) parses; what is set and not implemented
stays a 400 naming it."""

from __future__ import annotations

import json

import pytest

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request

USER = {"role": "user", "content": "hi"}
# what the openai SDK's ChatCompletionMessage.model_dump() gives for a plain answer
REPLAYED = {"role": "assistant", "content": "hello", "refusal": None, "annotations": [],
            "audio": None, "function_call": None, "tool_calls": None}


def parse(model, body):
    return parse_request(model, json.dumps(body).encode())


def rejected(model, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(model, body)
    assert info.value.status == 400
    return info.value


def test_nulls_take_the_defaults():
    chat = parse(ChatCompletionRequest, {
        "model": "m", "messages": [USER], "n": None, "stream": None, "logprobs": None,
        "top_logprobs": None, "temperature": None, "stream_options": None,
        "parallel_tool_calls": None, "min_tokens": None})
    assert (chat.n, chat.stream, chat.logprobs, chat.parallel_tool_calls, chat.min_tokens) == (
        1, False, False, True, 0)
    text = parse(CompletionRequest, {"model": "m", "prompt": "a", "echo": None, "n": None})
    assert (text.echo, text.n, text.max_tokens) == (False, 1, 16)


def test_null_keeps_meaning_none_where_a_field_takes_it():
    # max_tokens: null on completions is "up to the context", as before
    assert parse(CompletionRequest, {"model": "m", "prompt": "a", "max_tokens": None}
                 ).max_tokens is None


@pytest.mark.parametrize("field", ["store", "metadata", "service_tier", "reasoning_effort",
                                   "functions", "function_call", "prediction", "modalities"])
def test_null_for_a_field_baton_does_not_implement_is_accepted(field):
    assert parse(ChatCompletionRequest, {"model": "m", "messages": [USER], field: None}).n == 1


def test_a_set_value_baton_does_not_implement_is_still_a_400_naming_it():
    err = rejected(ChatCompletionRequest, {"model": "m", "messages": [USER], "store": True})
    assert err.param == "store"


def test_a_required_field_sent_as_null_is_still_required():
    assert rejected(ChatCompletionRequest, {"model": None, "messages": [USER]}).param == "model"


def test_logprobs_false_with_top_logprobs_zero_is_accepted():
    r = parse(ChatCompletionRequest, {"model": "m", "messages": [USER], "logprobs": False,
                                      "top_logprobs": 0})
    assert r.to_sampling_params().logprobs is None
    err = rejected(ChatCompletionRequest, {"model": "m", "messages": [USER],
                                           "logprobs": False, "top_logprobs": 2})
    assert "top_logprobs" in err.message


def test_a_message_replayed_from_a_response_parses():
    r = parse(ChatCompletionRequest, {"model": "m", "messages": [USER, REPLAYED, USER]})
    assert r.template_messages()[1] == {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize("field, value", [("refusal", "I can't"), ("audio", {"id": "a"}),
                                          ("annotations", [{"type": "url_citation"}])])
def test_a_replayed_response_field_that_is_set_is_a_400_naming_it(field, value):
    err = rejected(ChatCompletionRequest, {"model": "m", "messages": [
        USER, REPLAYED | {field: value}]})
    assert err.param == f"messages.1.{field}"


def test_an_image_part_says_the_model_takes_text():
    err = rejected(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
    assert err.param == "messages.0.content"
    assert "'image_url' are not supported: this model takes text" in err.message


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "a", "guided_json": DEEP},
    {"model": "m", "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
])
def test_json_nested_deep_inside_a_string_is_a_400(body):
    model = CompletionRequest if "prompt" in body else ChatCompletionRequest
    assert "nests too deeply" in rejected(model, body).message
