"""The strict OpenAI request schema shared by router and workers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request


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
    ({"model": "m", "prompt": "a", "logit_bias": {}}, "logit_bias"),
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
