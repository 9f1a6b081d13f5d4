"""A reasoning model served by a worker (`--reasoning-parser qwen3`) over a tiny random
Qwen3 with Qwen3's chat template: the thinking comes back as `reasoning_content`, whole
and streamed, and the raw output is transformers' greedy one; `chat_template_kwargs`
reach the template (`enable_thinking: false` closes the thinking in the prompt); a
structured output or a forced call starts after `</think>`; the Responses API gives the
thinking as a `reasoning` item. A logit bias on `</think>` makes the random model end its
thinking early."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from baton.engine.config import EngineConfig
from baton.worker.app import build_app
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.engine.tiny_qwen3 import save_tiny_qwen3
from tests.unit.worker.fakes import asgi_call, sse_events

MESSAGES = [{"role": "user", "content": "What is the weather like in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("ckpt") / "qwen3")


@pytest.fixture(scope="module")
def app(model):
    engine = EngineConfig.from_args(model=str(model), dtype="float32", num_kv_blocks=64)
    settings = WorkerSettings(engine=engine, served_model_name="tiny",
                              reasoning_parser="qwen3", tool_call_parser="hermes")
    state = WorkerState(settings)
    state.load()
    yield build_app(settings, state)
    state.engine.shutdown()


def post(app, path: str, body: dict):
    code, _, raw = asyncio.run(asgi_call(app, "POST", path, body))
    assert code == 200, raw
    return sse_events(raw) if body.get("stream") else json.loads(raw)


def end_id(app) -> int:
    return post(app, "/tokenize", {"model": "tiny", "prompt": "</think>",
                                   "add_special_tokens": False})["tokens"][0]


def chat(app, **extra) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
            "logit_bias": {str(end_id(app)): 3}} | extra


def test_thinking_is_split_from_the_answer_whole_and_streamed(app, model):
    body = chat(app)
    message = post(app, "/v1/chat/completions", body)["choices"][0]["message"]
    ids = post(app, "/tokenize", {"model": "tiny", "messages": MESSAGES})["tokens"]
    raw = post(app, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 16,
                                        "temperature": 0, "logit_bias": body["logit_bias"]})
    text = raw["choices"][0]["text"]
    assert "</think>" in text  # the bias ends the thinking within the 16 tokens
    assert message["reasoning_content"] + "</think>" + (message["content"] or "") == text
    # the same tokens as transformers' (the detokeniser holds back an unfinished UTF-8
    # character at the very end, which decoding the ids at once shows as U+FFFD)
    assert text == transformers_greedy(model, ids, 16, end_id(app), 3.0).rstrip("\ufffd")
    events = post(app, "/v1/chat/completions", body | {"stream": True})
    deltas = [e["choices"][0]["delta"] for _, e in events if isinstance(e, dict)
              and e.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")


def transformers_greedy(model, ids: list[int], n: int, biased: int, bias: float) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          sequence_bias={(biased,): bias}, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return AutoTokenizer.from_pretrained(model).decode(new, skip_special_tokens=True)


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(app):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    ids = post(app, "/tokenize", {"model": "tiny", "messages": MESSAGES} | kwargs)["tokens"]
    shown = post(app, "/detokenize", {"model": "tiny", "tokens": ids})["prompt"]
    assert shown.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    body = chat(app) | kwargs
    message = post(app, "/v1/chat/completions", body)["choices"][0]["message"]
    raw = post(app, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 16,
                                        "temperature": 0, "logit_bias": body["logit_bias"]})
    assert "reasoning_content" not in message  # not thinking: the output is the answer
    assert message["content"] == raw["choices"][0]["text"]


@pytest.mark.parametrize("kwargs", [{}, {"chat_template_kwargs": {"enable_thinking": False}}])
def test_a_structured_output_starts_after_the_thinking(app, kwargs):
    body = chat(app, max_tokens=40, logit_bias={str(end_id(app)): 100},
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "city", "schema": SCHEMA}}) | kwargs
    answer = post(app, "/v1/chat/completions", body)["choices"][0]
    assert answer["finish_reason"] == "stop"
    assert json.loads(answer["message"]["content"])["city"] in ("Paris", "Rome")
    thinking = not kwargs  # the biased </think> came first, then the grammar took over
    assert ("reasoning_content" in answer["message"]) == thinking
    assert answer["message"].get("reasoning_content") is None


def test_a_forced_call_is_read_from_the_answer_only(app):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    body = chat(app, max_tokens=40, tools=tools, tool_choice="required",
                logit_bias={str(end_id(app)): 100})
    answer = post(app, "/v1/chat/completions", body)["choices"][0]
    assert answer["finish_reason"] == "tool_calls"
    (call,) = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(app):
    body = {"model": "tiny", "input": "What is the weather like in Paris?",
            "max_output_tokens": 8, "temperature": 0}
    whole = post(app, "/v1/responses", body)
    chat_answer = post(app, "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    thought = chat_answer["choices"][0]["message"]["reasoning_content"]
    assert [i["type"] for i in whole["output"]] == ["reasoning"]  # no </think>: all thinking
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": thought}]
    assert whole["output"][0]["summary"] == [] and whole["status"] == "incomplete"
    code, _, raw = asyncio.run(asgi_call(app, "POST", "/v1/responses", body | {"stream": True}))
    events = [json.loads(b.split(b"\ndata: ", 1)[1]) for b in raw.split(b"\n\n") if b]
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") \
        == thought
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == thought
