"""The Responses API with the real `openai` client against `baton up` (the shared cluster:
router + 2 colocated workers, fp32): greedy output equal to the chat endpoint's for the same
conversation, streams assembled by the SDK's helpers, `responses.parse` with a pydantic
model, a function tool round trip, `previous_response_id`, GET / DELETE and the 404, and a
worker answering /v1/responses itself. (The OpenAI Agents SDK and LangChain are not
installed in this venv; the two-router Redis case is in test_registry_routing.py.)"""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.conftest import MODEL

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_output_tokens": 24}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 24}}, "required": ["city"],
               "additionalProperties": False}, "strict": True}


def chat_text(client, messages: list[dict], max_tokens: int = 24) -> str:
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=max_tokens)
    return answer.choices[0].message.content


def test_create_equals_chat_for_the_same_conversation(client):
    r = client.responses.create(model=MODEL, instructions="You answer in one sentence.",
                                input="Why is the sky blue?", **GREEDY)
    messages = [{"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": "Why is the sky blue?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == expected and r.max_output_tokens == 24


def test_streams_assemble_the_same_text(client):
    whole = client.responses.create(model=MODEL, input="Name three colors.", **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Name three colors.",
                                          stream=True, **GREEDY))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(model=MODEL, input="Name three colors.", **GREEDY) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
    # an incomplete stream ends with response.incomplete, which has no "final response"
    assert "".join(deltas) == whole.output_text
    if whole.status == "completed":
        assert s.get_final_response().output_text == whole.output_text


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


def test_parse_with_a_pydantic_model(client):
    r = client.responses.parse(model=MODEL, input="Name a city in France.", text_format=City,
                               temperature=0, max_output_tokens=64)
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, City)
    assert City.model_validate_json(r.output_text) == r.output_parsed


def test_a_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=64)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and first.status == "completed"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 21})}],
        **GREEDY)
    assert answer.output_text and answer.output[0].type == "message"
    # the same conversation sent whole, as items replayed from the first response
    again = client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none",
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 21})}],
        **GREEDY)
    assert again.output_text == answer.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.", **GREEDY)
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="What is my name?", **GREEDY)
    assert second.previous_response_id == first.id
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])


def test_retrieve_delete_and_the_404(client):
    r = client.responses.create(model=MODEL, input="Say yes.", metadata={"run": "t1"},
                                temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    assert got.metadata == {"run": "t1"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    unstored = client.responses.create(model=MODEL, input="Say no.", store=False,
                                       temperature=0, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", background=True)
    assert err.value.body["param"] == "background"


def test_a_worker_answers_responses_itself(cluster, client):
    worker = openai.OpenAI(base_url=cluster.workers[0] + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    r = worker.responses.create(model=MODEL, input="Why is the sky blue?", **GREEDY)
    assert r.output_text == client.responses.create(model=MODEL, input="Why is the sky blue?",
                                                    **GREEDY).output_text
    assert worker.responses.retrieve(r.id).output_text == r.output_text
    streamed = list(worker.responses.create(model=MODEL, input="Why is the sky blue?",
                                            stream=True, **GREEDY))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == \
        r.output_text
