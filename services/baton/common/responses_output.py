"""The OpenAI Responses API's answer: the `Response` object, its output items and usage, and
the stream's events, in the shapes the official SDK parses (`openai.types.responses`).

Built by `common.responses_format` from a chat answer, on the router and on a worker
serving /v1/responses itself; stored whole (`common.response_store`) for `GET
/v1/responses/{id}` and `previous_response_id`. An SSE event is `event: <type>` and one
`data:` line of JSON carrying the same `type` and the stream's `sequence_number`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from baton.common.responses_api import FunctionChoice, FunctionTool, ResponsesRequest, TextConfig

_OUT = ConfigDict(extra="forbid")
Status = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """An id of Baton's making: `resp_…`, `msg_…`, `fc_…`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    model_config = _OUT
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: tuple[()] = ()  # Baton makes no citations
    logprobs: tuple[()] = ()


class OutputMessage(BaseModel):
    model_config = _OUT
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A `function_call` item: the call the model made (`call_id` names it in the
    `function_call_output` the client sends back)."""

    model_config = _OUT
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class ReasoningText(BaseModel):
    model_config = _OUT
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """A `reasoning` item: a reasoning model's thinking, whole, as one `reasoning_text`
    part (no `summary`: Baton does not summarise it), as vLLM serves it."""

    model_config = _OUT
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: tuple[()] = ()
    content: list[ReasoningText]


OutputItem = Annotated[OutputMessage | FunctionCallOutput | ReasoningOutput,
                       Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    model_config = _OUT
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    model_config = _OUT
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    model_config = _OUT
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0) -> ResponseUsage:
        return cls(input_tokens=prompt, output_tokens=completion,
                   total_tokens=prompt + completion,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached),
                   output_tokens_details=OutputTokensDetails())


class ResponseError(BaseModel):
    model_config = _OUT
    code: str
    message: str


class IncompleteDetails(BaseModel):
    model_config = _OUT
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A Response: what the request asked (echoed), its status, output and usage."""

    model_config = _OUT
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    tools: list[FunctionTool]
    text: TextConfig
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None

    @classmethod
    def start(cls, request: ResponsesRequest, model: str) -> ResponseObject:
        """An in-progress Response to `request`, with no output yet."""
        return cls(
            id=new_id("resp"), created_at=int(time.time()), status="in_progress",
            instructions=request.instructions, metadata=request.metadata or {}, model=model,
            output=[], parallel_tool_calls=request.parallel_tool_calls,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            tools=request.tools or [], text=request.text or TextConfig(),
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store,
            user=request.user)

    @field_serializer("tools", "text")
    def _without_nulls(self, value: list[FunctionTool] | TextConfig) -> Any:
        if isinstance(value, list):
            return [t.model_dump(mode="json", exclude_none=True) for t in value]
        return value.model_dump(mode="json", exclude_none=True, by_alias=True)

    def dump(self) -> dict[str, Any]:  # JSON
        return self.model_dump(mode="json")

    @property
    def output_text(self) -> str:
        """The text of its messages (the SDK's `response.output_text`)."""
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)


# -- stream events -----------------------------------------------------------------------
class ResponseEvent(BaseModel):
    model_config = _OUT
    type: str
    sequence_number: int

    def sse(self) -> bytes:
        return (b"event: " + self.type.encode() + b"\ndata: "
                + self.model_dump_json().encode() + b"\n\n")


class LifecycleEvent(ResponseEvent):
    type: Literal["response.created", "response.in_progress", "response.completed",
                  "response.incomplete", "response.failed"]
    response: ResponseObject


class ItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class TextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: tuple[()] = ()


class TextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: tuple[()] = ()


class ReasoningDeltaEvent(ResponseEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningDoneEvent(ResponseEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDeltaEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta")
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = (
        "response.function_call_arguments.done")
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent):
    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None
