"""The OpenAI Responses API's request (`POST /v1/responses`), and its translation into the
chat pipeline's request (no torch).

Baton serves a Responses request as a chat completion: `ResponsesRequest.chat_body` turns
its `instructions`, its input items (after a stored conversation's, with
`previous_response_id`), its function tools, `tool_choice`, `text.format` and sampling
fields into a `/v1/chat/completions` body, so tokenisation through the chat template, tool
calls, structured outputs, P/D, retries and stream resumption are the chat path's. The
chat answer is turned back into a Response by `common.responses_format`.

Input items are messages (a string, or `input_text` / `output_text` parts), `function_call`
and `function_call_output` items, and `reasoning` items (a reasoning model's thinking,
given back to the template as the next assistant turn's `reasoning_content`); an output
message, call or reasoning replayed from a response (its `id`, `status`, empty
`annotations`) parses. Other item types, content parts and tools are
a 400 naming them; so is a field Baton does not implement, once set (`RequestModel`).
Beyond OpenAI's fields Baton takes `seed` and `stop`, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Literal, Self

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from baton.common.protocol import MAX_STOP, MAX_TOOLS
from baton.common.protocol import _Stop as StopString  # chat's stop strings, the same rules
from baton.common.request_model import RequestModel
from baton.common.sampling_params import SEED_MAX, SEED_MIN
from baton.common.tools import check_json_schema

_ItemStatus = Literal["in_progress", "completed", "incomplete"]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text")


class TextPart(RequestModel):
    """A message's text part; an `output_text` replayed from a response may carry its empty
    `annotations` and `logprobs`."""

    _EMPTY_IS_UNSET = frozenset({"annotations", "logprobs"})
    type: Literal["input_text", "output_text"]
    text: str


def _text_parts_only(content: object) -> object:
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS and kind is not None:
            raise ValueError(f"content parts of type {kind!r} are not supported: this model "
                             "takes text (parts of type 'input_text' or 'output_text', or a "
                             "string)")
    return content


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None  # an output message replayed: its id and status say nothing here
    status: _ItemStatus | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: object) -> object:
        return _text_parts_only(content)


class FunctionCallItem(RequestModel):
    """A call the model made, replayed (from a response's output, or the client's own)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: _ItemStatus | None = None

    @field_validator("arguments")
    @classmethod
    def _json(cls, text: str) -> str:
        try:
            json.loads(text)
        except ValueError:
            raise ValueError("a function_call's arguments must be JSON text") from None
        return text


class FunctionCallOutputItem(RequestModel):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[TextPart]
    id: str | None = None
    status: _ItemStatus | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, output: object) -> object:
        return _text_parts_only(output)


class ReasoningPart(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
    """A reasoning model's thinking, replayed: its `content` (else its `summary`) text."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None
    id: str | None = None
    status: _ItemStatus | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


def _item_type(item: object) -> str | None:
    if isinstance(item, dict):
        return str(item.get("type", "message"))  # an "easy" message has no type
    return getattr(item, "type", None)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None  # forced calls are always constrained; `auto` is parsed

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, schema: dict[str, object] | None) -> dict[str, object] | None:
        if schema is not None:
            check_json_schema(schema, "tools.parameters")
        return schema

    def chat_tool(self) -> dict[str, object]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")] | None = None
    description: str | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output is always constrained to the schema

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> Self:
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("text.format has a name and a schema exactly when its type is "
                             "json_schema")
        if self.schema_ is not None:
            check_json_schema(self.schema_, "text.format.schema")
        return self

    def response_format(self) -> dict[str, object]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = self.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(RequestModel):
    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(RequestModel):
    """POST /v1/responses."""

    _EMPTY_IS_UNSET = frozenset({"include", "reasoning"})  # nothing asked: nothing to refuse
    model: str
    input: Annotated[Annotated[str, Tag("text")]
                     | Annotated[list[InputItem], Field(min_length=1), Tag("items")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "items")]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    stream: bool = False
    store: bool = True
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items: object) -> object:
        for item in items if isinstance(items, list) else ():
            kind = _item_type(item)
            if kind not in ITEM_TYPES:
                raise ValueError(f"input items of type {kind!r} are not supported; Baton "
                                 f"takes {', '.join(ITEM_TYPES)}")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: object) -> object:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported; Baton serves "
                                 "function tools")
        return tools

    def input_items(self) -> list[Item]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_body(self, history: Sequence[Item] = ()) -> dict[str, object]:
        """The /v1/chat/completions body that answers this request after `history` (a
        stored conversation's items). A stream asks for usage: `response.completed` has
        it."""
        messages: list[dict[str, object]] = (
            [{"role": "system", "content": self.instructions}] if self.instructions else [])
        messages += chat_messages([*history, *self.input_items()])
        body: dict[str, object] = {"model": self.model, "messages": messages,
                                   "stream": self.stream,
                                   "parallel_tool_calls": self.parallel_tool_calls}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [t.chat_tool() for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format.type != "text":
            body["response_format"] = self.text.format.response_format()
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "seed", "stop", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


def chat_messages(items: Sequence[Item]) -> list[dict[str, object]]:
    """Input items as chat messages: calls join the assistant message they follow (or make
    one), each call's output is a `tool` message; a reasoning item starts an assistant
    message (its `reasoning_content`) that the next assistant text or calls complete."""
    messages: list[dict[str, object]] = []
    for item in items:
        last = messages[-1] if messages else None
        if isinstance(item, ReasoningItem):
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": item.text})
        elif isinstance(item, MessageItem) and item.role == "assistant" and last is not None \
                and last.get("reasoning_content") is not None and last["content"] == "" \
                and "tool_calls" not in last:
            last["content"] = _text(item.content)
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
        else:
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            calls = last.setdefault("tool_calls", [])
            assert isinstance(calls, list)  # set just above, or by an earlier call
            calls.append({"id": item.call_id, "type": "function",
                          "function": {"name": item.name, "arguments": item.arguments}})
    return messages
