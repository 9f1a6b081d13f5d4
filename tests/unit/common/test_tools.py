"""Tools in the request schema: what a template is given, and the JSON schema a forced call
is constrained to (checked by validating outputs against it)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.common.tools import NamedToolChoice, Tool, forced_schema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# pydantic's shape: a recursive schema through $defs
TREE = {"type": "function", "function": {"name": "plant", "parameters": {
    "$defs": {"Node": {"type": "object", "properties": {
        "label": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["label"]}},
    "type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}},
    "required": ["root"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def tools(*specs) -> list[Tool]:
    return [Tool.model_validate(s) for s in specs]


def valid(schema: dict, instance: object) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(instance)


def test_named_choice_generates_that_functions_arguments():
    choice = NamedToolChoice.model_validate({"type": "function",
                                             "function": {"name": "get_weather"}})
    schema = forced_schema(tools(WEATHER, NOW), choice, parallel=True)
    assert schema == WEATHER["function"]["parameters"]
    now = NamedToolChoice.model_validate({"type": "function", "function": {"name": "now"}})
    assert valid(forced_schema(tools(WEATHER, NOW), now, True), {})


def test_required_generates_an_array_of_named_calls():
    schema = forced_schema(tools(WEATHER, NOW), "required", parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    one = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert valid(schema, [one, {"name": "now", "parameters": {}}])
    assert not valid(schema, [])  # at least one call
    assert not valid(schema, [{"name": "get_weather", "parameters": {}}])  # its own schema
    assert not valid(schema, [{"name": "other", "parameters": {}}])
    single = forced_schema(tools(WEATHER, NOW), "required", parallel=False)
    assert valid(single, [one]) and not valid(single, [one, one])


def test_required_moves_referencing_schemas_to_the_root():
    schema = forced_schema(tools(WEATHER, TREE), "required", parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    tree = {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}
    assert valid(schema, [{"name": "plant", "parameters": {"root": tree}}])
    assert not valid(schema, [{"name": "plant", "parameters": {"root": {"children": []}}}])
    assert set(schema["$defs"]) == {"tool1", "tool1.Node"}


def test_auto_and_none_constrain_nothing():
    assert forced_schema(tools(WEATHER), "auto", True) is None
    assert forced_schema(tools(WEATHER), "none", True) is None


def test_template_sees_openai_tools_and_parsed_arguments():
    req = parse_request(ChatCompletionRequest, json.dumps({
        "model": "m", "tools": [WEATHER, NOW], "messages": [
            {"role": "user", "content": "Weather in Paris?", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}).encode())
    assert req.template_tools() == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "The weather in a city",
                                          "parameters": WEATHER["function"]["parameters"]}},
        {"type": "function", "function": {"name": "now", "parameters": {
            "type": "object", "properties": {}}}}]
    assert req.template_messages() == [
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]


@pytest.mark.parametrize("tool", [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}},
    {"type": "function", "function": {"name": "has space"}},
    {"type": "code_interpreter"},
])
def test_bad_tools_are_400s_naming_them(tool):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    with pytest.raises(OpenAIError) as info:
        parse_request(ChatCompletionRequest, json.dumps(body).encode())
    assert info.value.status == 400 and info.value.param.startswith("tools.0")


# Qwen 2.5's way with tools, shortened: tools as JSON lines, calls in <tool_call> tags with
# their arguments through `tojson`, results as <tool_response> in a user turn.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_router_renders_tools_and_calls_as_the_worker(model_dir):
    """The router's prompt ids (exact prefix routing) of a conversation with tools and
    calls are the worker's, and the template saw the calls' arguments as objects."""
    from baton.engine.tokenizer import apply_chat_template, load_tokenizer
    from baton.router.tokens import RouterTokenizer

    tok = load_tokenizer(model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    req = parse_request(ChatCompletionRequest, json.dumps({
        "model": "m", "tools": [WEATHER, TREE], "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}).encode())
    worker = apply_chat_template(tok, req.template_messages(), True,
                                 tools=req.template_tools())
    router = RouterTokenizer({"model": "m", "block_size": 16,
                              "tokenizer_json": tok.backend_tokenizer.to_str(),
                              "chat_template": TOOLS_TEMPLATE, "special_tokens": {}})
    assert router.prompt_ids("chat", req) == worker
    text = tok.decode(worker)
    assert '"arguments": {"city": "Paris"}' in text and '"name": "plant"' in text


def test_the_router_does_not_tokenise_a_prompt_that_fits_no_context(tokenizer):
    """With the worker's context in the tokenizer payload, a text longer than any prompt
    that fits (`common.prompt_bound`) is not tokenised on the router: the worker refuses it,
    and the router routes it without exact ids."""
    from baton.common.prompt_bound import max_prompt_chars
    from baton.router.tokens import RouterTokenizer

    tok = tokenizer
    payload = {"model": "m", "block_size": 16, "max_model_len": 32,
               "tokenizer_json": tok.backend_tokenizer.to_str(), "chat_template": None,
               "special_tokens": {}}
    router = RouterTokenizer(payload)
    bound = max_prompt_chars(payload["tokenizer_json"], 32)
    assert bound is not None

    def completion(prompt):
        return parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}
                                                           ).encode())

    assert router.prompt_ids("completions", completion("x" * (bound + 1))) is None
    assert router.prompt_ids("completions", completion("hello")) == tok.encode("hello")
