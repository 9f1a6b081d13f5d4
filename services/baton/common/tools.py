"""Tool calling in OpenAI's shape (no torch): a request's `tools` and `tool_choice`, an
assistant message's `tool_calls`, what a chat template is given of them, and the JSON
schema a forced call is constrained to.

The chat template sees what transformers' `apply_chat_template(tools=...)` passes: each
tool as OpenAI's `{"type": "function", "function": {name, description, parameters}}`, and
an assistant's calls with their `arguments` parsed into a dict, since the Qwen, Hermes,
Llama 3 and Mistral templates write them with `| tojson` (vLLM parses them the same way).

A forced call is constrained as vLLM does it: `tool_choice` naming a function generates
that function's arguments object; `required` generates a JSON array of
`{"name": <one of the tools>, "parameters": <its arguments>}` (one item unless
`parallel_tool_calls`). The worker's tool-call parsers (`worker.tool_parsers`) read the
output back into `tool_calls`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, cast

import jsonschema
from pydantic import Field, field_validator

from baton.common.request_model import RequestModel
from baton.common.structured_limits import SchemaTooLarge, check_schema_size

ARGUMENT_KEYS = ("arguments", "parameters")  # what models call a call's arguments
_EMPTY_OBJECT: dict[str, object] = {"type": "object", "properties": {}}


class ParamError(ValueError):
    """A validation error that names the request field it is about (`protocol.parse_request`
    puts it in the error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_json_schema(schema: object, param: str) -> None:
    """Raises ParamError naming `param` unless `schema` is a valid JSON Schema (checked
    against the metaschema of the draft it declares, 2020-12 by default) within
    `common.structured_limits`' bounds, which are checked first."""
    if not isinstance(schema, dict):
        raise ParamError(param, "must be a JSON Schema object")
    try:
        check_schema_size(schema)
    except SchemaTooLarge as err:
        raise ParamError(param, f"the schema is too large: {err}") from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "the top level"
        raise ParamError(param, f"not a valid JSON Schema: {err.message} (at {where})"
                         ) from None


class FunctionDefinition(RequestModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # forced calls are always constrained; `auto` is parsed

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, schema: dict[str, object] | None) -> dict[str, object] | None:
        if schema is not None:
            check_json_schema(schema, "tools.function.parameters")
        return schema


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, object]:
        f = self.function
        return {"type": "function", "function": {
            "name": f.name, **({"description": f.description} if f.description else {}),
            "parameters": f.parameters if f.parameters is not None else _EMPTY_OBJECT}}


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, text: str) -> str:
        try:
            json.loads(text)
        except ValueError:
            raise ValueError("a tool call's arguments must be JSON text") from None
        return text


class ToolCallParam(RequestModel):
    """A call in an assistant message of the conversation."""

    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall

    def template_dict(self) -> dict[str, object]:
        f = self.function
        return {"id": self.id, "type": "function",
                "function": {"name": f.name, "arguments": json.loads(f.arguments)}}


def _check_tool_choice(tools: list[Tool], choice: ToolChoice) -> None:
    """Raises ParamError("tool_choice") for a choice the tools cannot satisfy."""
    if choice == "none":
        return
    if not tools:
        raise ParamError("tool_choice", "only 'none' is allowed without tools")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise ParamError("tool_choice", f"{choice.function.name!r} is not one of the "
                                            f"tools {names}")


def forced_schema(tools: list[Tool], choice: ToolChoice, parallel: bool
                  ) -> dict[str, object] | None:
    """The JSON schema a forced call's output is constrained to, or None when the model
    chooses (`auto`, `none`). Raises ParamError("tool_choice") if the tools cannot
    satisfy the choice."""
    _check_tool_choice(tools, choice)
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return tool.function.parameters or _EMPTY_OBJECT
    if choice != "required":
        return None
    defs: dict[str, object] = {}
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _hoisted(t, i, defs)},
              "required": ["name", "parameters"]} for i, t in enumerate(tools)]
    schema: dict[str, object] = {"type": "array", "minItems": 1,
                                 "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoisted(tool: Tool, i: int, defs: dict[str, object]) -> object:
    """A tool's arguments schema as an item of the `required` array's schema. One that uses
    `$ref` moves to the root's `$defs` (as `tool<i>`, its own definitions beside it as
    `tool<i>.<name>`), its references rewritten, since they are relative to the root."""
    params = tool.function.parameters or _EMPTY_OBJECT
    if '"$ref"' not in json.dumps(params):
        return params
    key = f"tool{i}"
    # `parameters` passed its metaschema, so `$defs` / `definitions` are objects if present.
    own: dict[str, object] = {**cast("dict[str, object]", params.get("$defs", {})),
                              **cast("dict[str, object]", params.get("definitions", {}))}
    for name, sub in own.items():
        defs[f"{key}.{name}"] = _rebase(sub, key)
    defs[key] = _rebase({k: v for k, v in params.items()
                         if k not in ("$defs", "definitions")}, key)
    return {"$ref": f"#/$defs/{key}"}


def _rebase(node: object, key: str) -> object:
    if isinstance(node, list):
        return [_rebase(v, key) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase(v, key) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                out["$ref"] = f"#/$defs/{key}." + ref[len(prefix):]
                break
        else:  # the root itself, or a pointer into it
            out["$ref"] = f"#/$defs/{key}" + ref[1:]
    return out
