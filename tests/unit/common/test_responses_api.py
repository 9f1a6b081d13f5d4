"""A Responses request parsed and translated into the chat request that answers it: items
to messages, tools, tool_choice, text.format as the grammar constraint, sampling fields,
and what is refused with a 400 naming it."""

from __future__ import annotations

import json

import pytest

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest, parse_request
from baton.common.responses_api import MessageItem, ResponsesRequest
from baton.common.sampling_params import StructuredOutput

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": True}


def parse(**body) -> ResponsesRequest:
    return parse_request(ResponsesRequest, json.dumps({"model": "m"} | body).encode())


def chat(req: ResponsesRequest, history=()) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps(req.chat_body(history)).encode())


def refused(**body) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse(**body)
    assert err.value.status == 400
    return err.value


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    req = parse(input="Hi there", instructions="Answer briefly.", max_output_tokens=12,
                temperature=0, top_p=0.5, seed=7, stop=["\n"], user="u1")
    c = chat(req)
    assert c.template_messages() == [{"role": "system", "content": "Answer briefly."},
                                     {"role": "user", "content": "Hi there"}]
    params = c.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.seed,
            params.stop) == (12, 0.0, 0.5, 7, ["\n"])
    assert c.user == "u1" and not c.stream


def test_items_become_messages_with_calls_joined_to_the_assistant_turn():
    req = parse(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Paris?"}]},
        # an output message replayed from a response: id, status, empty annotations
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "20 C"}]}], tools=[WEATHER])
    messages = chat(req).template_messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather in Paris?"
    assistant = messages[2]
    assert assistant["content"] == "Let me check."
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        ("call_1", {"city": "Paris"}), ("call_2", {"city": "Lyon"})]
    assert (messages[3]["tool_call_id"], messages[3]["content"]) == ("call_1", "18 C")
    assert messages[4]["content"] == "20 C"


def test_a_call_with_no_assistant_text_before_it_makes_its_own_message():
    req = parse(input=[{"role": "user", "content": "x"},
                       {"type": "function_call", "call_id": "c", "name": "f",
                        "arguments": "{}"}])
    assert chat(req).template_messages()[1] == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": {}}}]}


def test_history_goes_before_the_input():
    req = parse(input="and now?", instructions="Be brief.")
    history = [MessageItem(role="user", content="first"),
               MessageItem(role="assistant", content="answer")]
    assert [m["content"] for m in chat(req, history).template_messages()] == [
        "Be brief.", "first", "answer", "and now?"]


def test_tools_and_tool_choice_reach_the_chat_request():
    c = chat(parse(input="x", tools=[WEATHER], tool_choice={"type": "function",
                                                            "name": "get_weather"},
                   parallel_tool_calls=False))
    assert c.tools[0].function.name == "get_weather" and c.tools[0].function.strict
    assert c.tool_choice.function.name == "get_weather" and not c.parallel_tool_calls
    forced = c.to_sampling_params().structured
    assert forced.kind == "json_schema" and json.loads(forced.spec) == WEATHER["parameters"]
    assert chat(parse(input="x", tools=[WEATHER])).effective_tool_choice == "auto"
    assert chat(parse(input="x", tools=[WEATHER], tool_choice="required")).tool_choice == \
        "required"


def test_text_format_is_the_grammar_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = chat(parse(input="x", text={"format": {"type": "json_schema", "name": "A",
                                               "schema": schema, "strict": True}}))
    assert c.to_sampling_params().structured == StructuredOutput("json_schema",
                                                                 json.dumps(schema))
    c = chat(parse(input="x", text={"format": {"type": "json_object"}}))
    assert c.to_sampling_params().structured == StructuredOutput("json_object")
    assert chat(parse(input="x", text={"format": {"type": "text"}})).response_format is None


def test_a_stream_asks_for_usage():
    c = chat(parse(input="x", stream=True))
    assert c.stream and c.include_usage


def test_nulls_and_empty_lists_the_sdk_sends_are_not_set():
    req = parse(input="x", metadata=None, include=[], reasoning=None, service_tier=None,
                store=None, truncation=None, previous_response_id=None)
    assert req.store and req.truncation == "disabled" and req.metadata is None


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"background": True}, "background", "does not implement"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input", "'computer_call'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "takes text"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input", "JSON text"),
    ({"text": {"format": {"type": "json_schema", "name": "A"}}}, "text", "schema"),
    ({"input": []}, "input", "at least 1"),
])
def test_what_baton_does_not_take_is_a_400_naming_it(body, param, words):
    err = refused(**({"input": "x"} | body))
    assert err.param.startswith(param) and words in err.message, err.message
