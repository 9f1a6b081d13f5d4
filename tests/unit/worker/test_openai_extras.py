"""The rest of the OpenAI / vLLM surface through a worker (scripted engine, real HTTP app):
structured outputs and logit_bias into the sampling parameters, priority, echo with
logprobs, /tokenize and /detokenize, and usage on every chunk."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat import ChatCompletionChunk

from baton.common.roles import Role
from baton.engine.sampler import TokenLogprobs
from baton.worker.app import build_app
from baton.worker.openai_api import Internal
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.worker.fakes import (
    MODEL,
    FakeEngine,
    asgi_call,
    count_to,
    make_pipeline,
    out,
    sse_events,
)
from tests.unit.worker.test_openai_api import completion_request, stream

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def worker(script=None, **pipeline):
    state = WorkerState(WorkerSettings(role=Role.BOTH))
    state.pipeline, state.engine, _ = make_pipeline(FakeEngine(script or count_to(3)),
                                                    **pipeline)
    return build_app(state.settings, state), state.engine


def post(app, path: str, body: dict) -> tuple[int, object]:
    code, _, raw = asyncio.run(asgi_call(app, "POST", path, body))
    if body.get("stream") and code == 200:
        return code, [e for _, e in sse_events(raw) if e != "[DONE]"]
    return code, json.loads(raw)


@pytest.mark.parametrize("extra, kind, spec", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, "grammar", 'root ::= "yes" | "no"'),
])
def test_output_constraints_reach_the_engine(extra, kind, spec):
    app, engine = worker()
    assert post(app, "/v1/chat/completions", CHAT | extra)[0] == 200
    structured = engine.made[0].params.structured
    assert structured.kind == kind
    assert (json.loads(structured.spec) if kind == "json_schema" else structured.spec) == spec


def test_plain_text_format_constrains_nothing_and_bad_schemas_are_400s():
    app, engine = worker()
    assert post(app, "/v1/completions", {"model": MODEL, "prompt": "x",
                                         "response_format": {"type": "text"}})[0] == 200
    assert engine.made[0].params.structured is None
    bad = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "required": "n"}}}}
    code, body = post(app, "/v1/chat/completions", CHAT | bad)
    assert code == 400 and body["error"]["param"].startswith("response_format")
    assert "not a valid JSON Schema" in body["error"]["message"]
    code, body = post(app, "/v1/chat/completions", CHAT | {"guided_regex": "a",
                                                           "guided_json": SCHEMA})
    assert code == 400 and "each constrain the output" in body["error"]["message"]


def test_logit_bias_is_keyed_by_token_id():
    app, engine = worker()
    bias = {"7": 2.5, "100": -100}
    assert post(app, "/v1/chat/completions", CHAT | {"logit_bias": bias})[0] == 200
    assert engine.made[0].params.logit_bias == {7: 2.5, 100: -100.0}
    code, body = post(app, "/v1/chat/completions", CHAT | {"logit_bias": {"7": 101}})
    assert code == 400 and body["error"]["param"] == "logit_bias.7"


def test_priority_needs_a_priority_scheduling_worker():
    app, engine = worker()
    code, body = post(app, "/v1/chat/completions", CHAT | {"priority": 5})
    assert code == 400 and body["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in body["error"]["message"]
    assert post(app, "/v1/chat/completions", CHAT | {"priority": 0})[0] == 200


def test_priority_reaches_the_engine():
    app, engine = worker(priority_scheduling=True)
    assert post(app, "/v1/chat/completions", CHAT | {"priority": -3})[0] == 200
    assert engine.made[0].priority == -3


def prompt_logprobs_script(req):
    """The prompt's logprobs on the first output (the first token's None)."""
    ids = req.prompt_token_ids
    lps = [None] + [TokenLogprobs(t, -1.0, 2, [(t, -1.0), (0, -0.25)]) for t in ids[1:]]
    return [[out(req.request_id, [10], logprobs=True, prompt_logprobs=lps)],
            [out(req.request_id, [11], logprobs=True, finish="length")]]


def test_echo_with_logprobs_puts_the_prompts_first():
    app, engine = worker(prompt_logprobs_script)
    code, body = post(app, "/v1/completions", {"model": MODEL, "prompt": "ab", "echo": True,
                                               "logprobs": 1, "max_tokens": 2})
    assert code == 200 and engine.made[0].params.prompt_logprobs == 1
    choice = body["choices"][0]
    assert choice["text"] == "ab<10><11>"
    assert choice["logprobs"] == {
        "tokens": ["<97>", "<98>", "<10>", "<11>"],
        "token_logprobs": [None, -1.0, -0.5, -0.5],
        "top_logprobs": [None, {"<98>": -1.0, "<0>": -0.25}, {}, {}],
        "text_offset": [0, 4, 2, 6]}


def test_streamed_echo_with_logprobs_comes_with_the_first_tokens():
    req = completion_request(prompt="ab", echo=True, logprobs=1, max_tokens=2, stream=True)
    chunks, _ = stream("completions", req, prompt_logprobs_script, prompts=([97, 98],))
    first, second = chunks[0][0][1]["choices"][0], chunks[1][0][1]["choices"][0]
    assert first["text"] == "ab<10>"
    assert first["logprobs"]["tokens"] == ["<97>", "<98>", "<10>"]
    assert first["logprobs"]["token_logprobs"] == [None, -1.0, -0.5]
    assert second["text"] == "<11>" and second["logprobs"]["text_offset"] == [6]
    # for a router: the echo's characters are counted with the first tokens' event
    chunks, _ = stream("completions", req, prompt_logprobs_script, Internal(True),
                       prompts=([97, 98],))
    (_, header), (_, opening) = chunks[0]
    assert header.get("text_chars", 0) == 0 and opening["choices"][0]["text"] == ""
    (_, tokens), (_, content) = chunks[1]
    assert tokens["text_chars"] == len("ab<10>") and content["choices"][0]["text"] == "ab<10>"


def test_tokenize_and_detokenize():
    app, engine = worker()
    engine.tokenizer.bos = 1
    assert post(app, "/tokenize", {"model": MODEL, "prompt": "hi"}) == (200, {
        "count": 3, "max_model_len": 64, "tokens": [1, 104, 105], "token_strs": None})
    _, body = post(app, "/tokenize", {"prompt": "hi", "add_special_tokens": False,
                                      "return_token_strs": True})
    assert body["tokens"] == [104, 105] and body["token_strs"] == ["<104>", "<105>"]
    tool = {"type": "function", "function": {"name": "f"}}
    _, body = post(app, "/tokenize", {"model": MODEL, "tools": [tool],
                                      "messages": [{"role": "user", "content": "a"}]})
    assert body["tokens"] == [1, ord("a"), ord("f")]  # through the template, tools too
    assert post(app, "/detokenize", {"model": MODEL, "tokens": [5, 6]}) == (
        200, {"prompt": "<5><6>"})
    code, body = post(app, "/detokenize", {"tokens": [1 << 20]})
    assert code == 400 and body["error"]["param"] == "tokens"
    assert post(app, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    assert post(app, "/tokenize", {"prompt": "x", "tools": []})[0] == 400


def test_continuous_usage_is_on_every_chunk():
    app, _ = worker()
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, events = post(app, "/v1/chat/completions", CHAT | {"stream": True,
                                                          "stream_options": options})
    for event in events:
        ChatCompletionChunk.model_validate(event)
    used = [e["usage"]["completion_tokens"] for e in events]
    assert used == sorted(used) and used[0] == 0 and used[-1] == 3
    assert events[-1]["choices"] == [] and events[-1]["usage"] == events[-2]["usage"]
    _, events = post(app, "/v1/chat/completions", CHAT | {
        "stream": True, "stream_options": {"include_usage": True}})
    assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]


def test_tokenize_refuses_a_text_longer_than_any_prompt_that_fits():
    """/tokenize takes the prompt bound the completions path takes (`common.prompt_bound`):
    a text no tokenisation could fit is a 400 before it is tokenised."""
    state = WorkerState(WorkerSettings(role=Role.BOTH))
    state.pipeline, state.engine, _ = make_pipeline(FakeEngine(count_to(3)))
    state.pipeline.max_prompt_chars = 64 * 4  # a tokenizer whose longest token is 4 chars
    app = build_app(state.settings, state)
    code, body = post(app, "/tokenize", {"prompt": "x" * (64 * 4 + 1)})
    assert code == 400 and body["error"]["code"] == "context_length_exceeded"
    assert post(app, "/tokenize", {"prompt": "x" * (64 * 4)})[0] == 200
