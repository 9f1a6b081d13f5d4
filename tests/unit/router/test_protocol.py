"""The strict OpenAI request schema shared by router and workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton.common.errors import OpenAIError
from baton.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from baton.common.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_tokenize_request,
)


def parse(model, body):
    return parse_request(model, json.dumps(body).encode())


def test_chat_maps_to_sampling_params():
    r = parse(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_k": -1,
        "seed": 3, "stop": "x", "logprobs": True, "top_logprobs": 2})
    p = r.to_sampling_params()
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.logprobs) == (
        7, 0.0, 0, 3, ["x"], 2)
    assert r.messages[0].as_template_dict() == {"role": "user", "content": "ab"}
    assert parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "x"}]}).to_sampling_params().max_tokens is None


def test_completion_prompts_forms():
    assert parse(CompletionRequest, {"model": "m", "prompt": "a"}).prompts() == ["a"]
    assert parse(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse(CompletionRequest, {"model": "m", "prompt": [[1], [2]]}).prompts() == [[1], [2]]
    assert parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert parse(CompletionRequest, {"model": "m", "prompt": "a"}).max_tokens == 16


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "a", "logit_bias": {"5x": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "a", "temperature": "1"}, "temperature"),
    ({"model": "m", "prompt": "a", "n": True}, "n"),
    ({"model": "m", "prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"model": "m", "prompt": "a", "top_p": 0}, "top_p"),
])
def test_rejections_name_the_field(body, param):
    with pytest.raises(OpenAIError) as info:
        parse(CompletionRequest, body).to_sampling_params()
    assert info.value.status == 400
    assert param in (info.value.param or "") or param in info.value.message


def test_malformed_json_is_a_400():
    with pytest.raises(OpenAIError) as info:
        parse_request(CompletionRequest, b"{nope")
    assert info.value.status == 400 and "JSON" in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_router_side_never_imports_torch():
    code = ("import sys, baton, baton.cli, baton.router.app, baton.router.retry, "
            "baton.common.protocol, baton.common.metrics; "
            "baton.router.app.build_app(baton.router.app.RouterSettings(('http://x:1',))); "
            "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_new_fields_map_to_sampling_params():
    r = parse(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "logit_bias": {"42": -100, "7": 1.5}, "priority": -2,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "out", "schema": {"type": "object"}}}})
    p = r.to_sampling_params()
    assert p.logit_bias == {42: -100.0, 7: 1.5} and r.priority == -2
    assert (p.structured.kind, json.loads(p.structured.spec)) == ("json_schema",
                                                                  {"type": "object"})
    c = parse(CompletionRequest, {"model": "m", "prompt": "a", "echo": True, "logprobs": 3,
                                  "guided_regex": "[a-z]+"})
    p = c.to_sampling_params()
    assert (p.prompt_logprobs, p.logprobs, p.structured.kind) == (3, 3, "regex")
    assert parse(CompletionRequest, {"model": "m", "prompt": "a", "logprobs": 3}
                 ).to_sampling_params().prompt_logprobs is None


def test_tool_messages_and_their_rules():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}
    r = parse(ChatCompletionRequest, {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]}]})
    assert r.effective_tool_choice == "auto" and r.to_sampling_params().structured is None
    assert r.messages[2].as_template_dict() == {"role": "tool", "content": "ok",
                                                "tool_call_id": "call_1"}
    for bad in ({"role": "tool", "content": "ok"},  # which call it answers
                {"role": "user", "content": "x", "tool_call_id": "c"},
                {"role": "user", "content": "x", "tool_calls": [call]},
                {"role": "assistant", "content": None},
                {"role": "assistant", "tool_calls": [call | {"function": {
                    "name": "f", "arguments": "not json"}}]}):
        with pytest.raises(OpenAIError) as info:
            parse(ChatCompletionRequest, {"model": "m", "messages": [bad]})
        assert info.value.status == 400 and info.value.param.startswith("messages.0")


def test_internal_messages_carry_the_new_fields_as_sent():
    """A prefill / decode pod re-parses what the router serialised: aliases (`schema`) and
    null assistant content survive the round trip."""
    from baton.common.internal import GenerateRequest

    body = {"model": "m", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "priority": 1, "logit_bias": {"3": 1},
            "messages": [{"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "cold"}]}
    wire = GenerateRequest(api="chat", request=parse(ChatCompletionRequest, body)).to_json()
    again = GenerateRequest.model_validate_json(wire).request
    assert again.to_sampling_params() == parse(ChatCompletionRequest,
                                               body).to_sampling_params()
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}
    wire = GenerateRequest(api="chat", request=parse(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "response_format": fmt})).to_json()
    assert json.loads(wire)["request"]["response_format"] == fmt


def test_tokenize_bodies():
    assert isinstance(parse_tokenize_request(b'{"prompt": "a"}'), TokenizeCompletionRequest)
    chat = parse_tokenize_request(b'{"model": "m", "messages": [{"role": "user", '
                                  b'"content": "a"}]}')
    assert isinstance(chat, TokenizeChatRequest) and chat.template_tools() is None
    for bad in (b'{"prompt": "a", "messages": []}', b'{"prompt": 1}', b"[1]", b"{",
                b'{"messages": [{"role": "user", "content": "a"}], "tools": []}',
                b'{"messages": [{"role": "user", "content": "a"}], '
                b'"add_special_tokens": true}'):
        with pytest.raises(OpenAIError) as info:
            parse_tokenize_request(bad)
        assert info.value.status == 400
    assert parse_request(DetokenizeRequest, b'{"tokens": [1, 2]}').tokens == [1, 2]


def test_router_sends_tokenize_calls_to_a_worker_of_the_model():
    import asyncio

    import aiohttp
    from aiohttp import web

    from tests.unit.router.fakes import FakePod, start, stop

    async def answer(pod, request, body):
        return web.json_response({"path": request.path, "body": json.loads(body)})

    async def main():
        router, pods = await start(FakePod("both", answer))
        try:
            async with aiohttp.ClientSession() as session:
                results = []
                for path, body in (("/tokenize", {"model": "m", "prompt": "hi"}),
                                   ("/detokenize", {"tokens": [1]}),
                                   ("/tokenize", {"model": "m", "prompt": 3}),
                                   ("/tokenize", {"model": "nope", "prompt": "x"})):
                    async with session.post(router.make_url(path), json=body) as resp:
                        results.append((resp.status, await resp.json()))
                return results, len(pods[0].bodies)
        finally:
            await stop(router, pods)

    results, forwarded = asyncio.run(main())
    assert results[0] == (200, {"path": "/tokenize", "body": {"model": "m", "prompt": "hi"}})
    assert results[1] == (200, {"path": "/detokenize", "body": {"tokens": [1]}})
    assert results[2][0] == 400 and results[3][0] == 404  # answered by the router
    assert forwarded == 2
