"""The prefill and decode roles' internal endpoints through the real app, over a scripted
engine: typed bodies (a bad one is an OpenAI-shaped 400), held and pulled KV, token events,
resumed streams."""

from __future__ import annotations

import asyncio
import json

import pytest

from baton.common.internal import PrefillResponse
from baton.common.roles import Role
from baton.engine.kv_connector import HoldKV, PullKV
from baton.worker.app import WorkerSettings, WorkerState, build_app
from tests.unit.worker.fakes import (
    MODEL,
    FakeEngine,
    asgi_call,
    kv_params,
    make_pipeline,
    out,
    sse_events,
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 0.5, "seed": 3, "stop": ["x"]}
PROMPT = [1, 104, 105]  # the fake chat template's ids of CHAT's messages


def make_app(role: Role, engine: FakeEngine | None = None):
    state = WorkerState(WorkerSettings(role=role))
    state.pipeline, engine, _ = make_pipeline(engine)
    state.engine = engine
    return build_app(state.settings, state), engine


def post(app, path: str, body, **headers):
    return asyncio.run(asgi_call(app, "POST", path, body, headers))


def test_prefill_holds_the_kv_and_answers_a_prefill_response():
    held = kv_params(len(PROMPT))
    app, engine = make_app(Role.PREFILL, FakeEngine(lambda r: [[out(
        r.request_id, [5], finish="length", kv_transfer_params=held)]]))
    code, _, raw = post(app, "/internal/prefill", {"api": "chat", "request": CHAT},
                        **{"X-Request-Id": "p1"})
    assert code == 200, raw
    answer = PrefillResponse.model_validate_json(raw)
    assert (answer.prompt_token_ids, answer.kv_transfer_params) == (PROMPT, held)
    (req,) = engine.made
    assert req.kv == HoldKV()
    assert req.request_id.startswith("prefill-") and "p1" not in req.request_id  # ours
    p = req.params  # the request's sampling, for one token, with no stop conditions
    assert (p.temperature, p.seed, p.n, p.max_tokens, p.stop, p.ignore_eos, p.logprobs) == (
        0.5, 3, 1, 1, [], True, None)


def test_a_prefill_that_ends_without_kv_is_a_500():
    app, _ = make_app(Role.PREFILL, FakeEngine(lambda r: [[out(r.request_id, [5],
                                                               finish="abort")]]))
    code, _, raw = post(app, "/internal/prefill", {"api": "chat", "request": CHAT})
    assert code == 500 and b"prefill_failed" in raw


def test_generate_pulls_the_kv_and_streams_token_events():
    app, engine = make_app(Role.DECODE)
    pulled = kv_params(3)
    code, head, raw = post(app, "/internal/generate", {
        "api": "chat", "request": CHAT | {"stream": True}, "prompt_token_ids": [7, 8, 9],
        "kv_transfer_params": pulled.model_dump(), "return_token_ids": True})
    assert code == 200 and head["content-type"].startswith("text/event-stream")
    (req,) = engine.made
    assert (req.prompt_token_ids, req.kv, req.presampled) == ([7, 8, 9], PullKV(pulled), 0)
    events = sse_events(raw)
    assert [kind for kind, _ in events] == ["tokens", "data"] + ["tokens", "data"] * 3 + [
        "data"]
    assert events[0][1]["prompt_token_ids"] == [7, 8, 9]
    assert [e.get("token_ids") for kind, e in events if kind == "tokens"] == [
        None, [10], [11], [12]]
    assert not any("token_ids" in str(e) for kind, e in events if kind == "data")


def test_a_resumed_generate_continues_the_stream():
    app, engine = make_app(Role.DECODE)
    code, _, raw = post(app, "/internal/generate", {
        "api": "completions", "return_token_ids": True,
        "request": {"model": MODEL, "prompt": "ab", "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True}},
        "prompt_token_ids": [97, 98, 50], "resume": {
            "prompt_tokens": 2, "completion_tokens": 1, "text_offset": 4, "created": 42}})
    assert code == 200, raw
    assert engine.made[0].presampled == 1  # a seeded sampler skips the sent token's draw
    events = sse_events(raw)
    assert events[0] == ("tokens", {"prompt_token_ids": [97, 98, 50], "header": {
        "id": events[2][1]["id"], "object": "text_completion", "created": 42,
        "model": MODEL}})
    assert events[1][0] == "tokens"  # no opening chunk: the client has it
    assert events[-2][1]["usage"]["prompt_tokens"] == 2
    assert events[-2][1]["usage"]["completion_tokens"] == 1 + 3


@pytest.mark.parametrize("body, param", [
    ({"api": "chat", "request": CHAT, "prompt_token_ids": [1, 2],
      "resume": {"prompt_tokens": 5}}, None),
    ({"api": "chat", "request": CHAT, "extra": 1}, "extra"),
    ({"api": "tokens", "request": CHAT}, "api"),
    ({"api": "chat", "request": CHAT | {"n": 2}, "return_token_ids": True},
     "return_token_ids"),
])
def test_a_bad_generate_body_is_an_openai_400(body, param):
    app, engine = make_app(Role.DECODE)
    code, _, raw = post(app, "/internal/generate", body)
    assert code == 400, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert engine.submitted == []


@pytest.mark.parametrize("role, path", [(Role.PREFILL, "/internal/generate"),
                                        (Role.BOTH, "/internal/generate"),
                                        (Role.BOTH, "/internal/prefill")])
def test_each_role_has_only_its_own_internal_endpoint(role, path):
    """(A decode pod answers /internal/prefill too: how it lends a peer a prefix.)"""
    app, _ = make_app(role)
    assert post(app, path, {"api": "chat", "request": CHAT})[0] == 404


def test_prefill_hands_over_its_first_tokens_logprobs_when_asked():
    held = kv_params(len(PROMPT))
    app, engine = make_app(Role.PREFILL, FakeEngine(lambda r: [[out(
        r.request_id, [5], finish="length", logprobs=True, kv_transfer_params=held)]]))
    request = CHAT | {"logprobs": True, "top_logprobs": 2}
    code, _, raw = post(app, "/internal/prefill", {"api": "chat", "request": request})
    assert code == 200, raw
    first = PrefillResponse.model_validate_json(raw).kv_transfer_params.first_token_logprobs
    assert (first.logprob, first.rank) == (-0.5, 1)
    assert engine.made[0].params.logprobs == 2  # the prefill samples with the request's k
