"""Real clients, unmodified, against `baton up` (the shared cluster: router + 2 colocated
workers, fp32), each run in the side venv of `client_venv.py`: the OpenAI Agents SDK with
its default model (`OpenAIResponsesModel` over /v1/responses, tracing off) running an agent
with a function tool to completion, and LangChain's `ChatOpenAI(use_responses_api=True)`:
invoke (greedy text equal to chat's), stream, and `bind_tools` with a forced call."""

from __future__ import annotations

import json

import pytest

from tests.integration.client_venv import run_client, venv_python
from tests.integration.conftest import MODEL

pytestmark = pytest.mark.slow

AGENT = f'''
import asyncio, json, os
from openai import AsyncOpenAI
from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                    set_tracing_disabled)

set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=os.environ["BASE_URL"] + "/v1",
                                      max_retries=0), use_for_tracing=False)
cities = []

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    cities.append(city)
    return "Sunny, 21 degrees."

agent = Agent(name="weather", model="{MODEL}", tools=[get_weather],
              instructions="Answer questions about the weather with the get_weather tool.",
              model_settings=ModelSettings(temperature=0, max_tokens=48,
                                           tool_choice="required"))
result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
print(json.dumps({{"cities": cities, "kinds": [item.type for item in result.new_items],
                  "final": result.final_output, "responses": len(result.raw_responses),
                  "response_ids": [r.response_id for r in result.raw_responses]}}))
'''

LANGCHAIN = f'''
import json, os
from langchain_openai import ChatOpenAI

llm = ChatOpenAI(model="{MODEL}", base_url=os.environ["BASE_URL"] + "/v1", api_key="unused",
                 use_responses_api=True, temperature=0, max_tokens=24, max_retries=0)
question = "Why is the sky blue? Answer in one sentence."
whole = llm.invoke(question)
streamed = "".join(chunk.text for chunk in llm.stream(question))

def get_weather(city: str) -> str:
    """The weather in a city."""
    return "Sunny"

call = llm.bind(max_tokens=64).bind_tools([get_weather], tool_choice="get_weather",
                                          strict=True).invoke("What is the weather in Paris?")
print(json.dumps({{"whole": whole.text, "streamed": streamed,
                  "calls": [(c["name"], c["args"]) for c in call.tool_calls],
                  "response_id": whole.response_metadata.get("id")}}))
'''


@pytest.fixture(scope="session")
def clients_python():
    return venv_python()


def test_the_agents_sdk_runs_an_agent_with_a_function_tool(clients_python, cluster):
    out = json.loads(run_client(clients_python, AGENT, cluster.router).splitlines()[-1])
    assert out["cities"] and all(isinstance(c, str) and c for c in out["cities"])
    assert "tool_call_item" in out["kinds"] and "tool_call_output_item" in out["kinds"]
    assert out["kinds"][-1] == "message_output_item"  # it ran to a final answer
    assert isinstance(out["final"], str) and out["final"]
    # the Responses model: every model call was a response of ours
    assert all(r.startswith("resp_") for r in out["response_ids"])


def test_langchain_on_the_responses_api(clients_python, cluster, client):
    out = json.loads(run_client(clients_python, LANGCHAIN, cluster.router).splitlines()[-1])
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "Why is the sky blue? Answer in one sentence."}])
    assert out["whole"] == chat.choices[0].message.content == out["streamed"]
    assert out["response_id"].startswith("resp_")
    (name, args), = out["calls"]
    assert name == "get_weather" and isinstance(args["city"], str)
