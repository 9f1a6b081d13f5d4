"""The OpenAI request shapes Baton accepts, shared by the router and the workers (no torch).

Requests are parsed strictly: a wrong JSON type is an error (no "0.5" -> 0.5 coercion) and
a field we do not implement is rejected with a 400 that names it, never silently ignored.
Beyond OpenAI's fields we take vLLM's usual extras (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `repetition_penalty`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `priority`, `guided_json` / `guided_regex` / `guided_grammar`,
`stream_options.continuous_usage_stats`) under the same names (vLLM's `/tokenize` and
`/detokenize` bodies are in `common.tokenize_protocol`). Tools and tool calls are in
`common.tools`; how every request model parses (null is "not set") in
`common.request_model`.

An output constraint (`response_format` json_object / json_schema, a `guided_*` field, or
a forced tool call) becomes `SamplingParams.structured`; a request may have one.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from baton.common.errors import OpenAIError
from baton.common.request_model import STRICT, RequestModel
from baton.common.sampling_params import (
    LOGIT_BIAS_MAX,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    StructuredOutput,
)
from baton.common.structured_limits import MAX_GRAMMAR_CHARS, MAX_REGEX_CHARS
from baton.common.tools import (
    ParamError,
    Tool,
    ToolCallParam,
    ToolChoice,
    check_json_schema,
    forced_schema,
)

MAX_LOGPROBS = 20
MAX_STOP = 256  # stop strings, and stop token ids: each is checked on every token
MAX_STOP_CHARS = 4096
MAX_TOOLS = 128  # OpenAI's limit
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (with include_usage)


class JsonSchemaSpec(RequestModel):
    """`response_format.json_schema`; `schema` is a JSON Schema (checked when parsed)."""

    model_config = ConfigDict(**STRICT, serialize_by_alias=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, object] = Field(alias="schema")
    strict: bool | None = None  # the output is always constrained to the schema

    @field_validator("schema_")
    @classmethod
    def _valid(cls, schema: dict[str, object]) -> dict[str, object]:
        check_json_schema(schema, "response_format.json_schema.schema")
        return schema


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> Self:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format has json_schema exactly when its type is "
                             "json_schema")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_schema":
            assert self.json_schema is not None  # _schema_iff_json_schema
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))
        return StructuredOutput("json_object") if self.type == "json_object" else None


_Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]


class _SamplingFields(RequestModel):
    """Fields common to both endpoints."""

    model: str
    n: Annotated[int, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=1 << 31)]],
                              Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # token id (a string of digits, as JSON keys are) -> bias added to its logit
    logit_bias: dict[str, _Bias] | None = None
    priority: Annotated[int, Field(ge=-(1 << 31), lt=1 << 31)] = 0  # lower runs first
    response_format: ResponseFormat | None = None
    guided_json: dict[str, object] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1, max_length=MAX_REGEX_CHARS)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1,
                                         max_length=MAX_GRAMMAR_CHARS)] | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> Self:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not (key.isascii() and key.isdigit() and int(key) < 1 << 31):
                raise ValueError(f"logit_bias keys are token ids (strings of digits), not "
                                 f"{key!r}")
        return bias

    @field_validator("guided_json")
    @classmethod
    def _guided_schema(cls, schema: dict[str, object] | str | None) -> object:
        # JSON text: parsed here, kept as the object
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise ValueError("guided_json is not JSON") from None
        check_json_schema(schema, "guided_json")
        return schema

    @model_validator(mode="after")
    def _one_constraint(self) -> Self:
        names = list(self.constraints())
        if len(names) > 1:
            raise ParamError(names[1], f"{' and '.join(names)} each constrain the output; "
                                       "send one of them")
        return self

    def constraints(self) -> dict[str, StructuredOutput]:
        """The output constraints the request asks for, by the field that asks (at most
        one once parsed)."""
        out: dict[str, StructuredOutput] = {}
        spec = self.response_format.structured() if self.response_format is not None else None
        if spec is not None:  # None: no response_format, or type "text"
            out["response_format"] = spec
        if self.guided_json is not None:
            out["guided_json"] = StructuredOutput("json_schema", json.dumps(self.guided_json))
        if self.guided_regex is not None:
            out["guided_regex"] = StructuredOutput("regex", self.guided_regex)
        if self.guided_grammar is not None:
            out["guided_grammar"] = StructuredOutput("grammar", self.guided_grammar)
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed,
                max_tokens=max_tokens, min_tokens=self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                skip_special_tokens=self.skip_special_tokens, logit_bias=bias,
                structured=next(iter(self.constraints().values()), None),
                prompt_logprobs=prompt_logprobs)
        except ValueError as err:
            field = str(err).split("=", 1)[0].removeprefix("SamplingParams.")
            raise OpenAIError(400, str(err), param=field) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's `continuous_usage_stats`, with `include_usage`)."""
        return (self.include_usage and self.stream_options is not None
                and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of token ids,
    or a list of token-id lists; several prompts give `len(prompts) * n` choices."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self) -> Self:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    @property
    def prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs`: the prompt's tokens get logprobs too."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, self.prompt_logprobs)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    """One message of a conversation. `content` may be null only in an assistant message
    with `tool_calls`; it is then "" (as vLLM: templates concatenate it). A message replayed
    from a response (`message.model_dump()`) carries OpenAI's response fields: empty, they
    mean nothing and are left out; set, they are a 400 naming them."""

    _EMPTY_IS_UNSET = frozenset({"refusal", "annotations", "audio", "function_call"})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant
    tool_call_id: Annotated[str, Field(min_length=1)] | None = None  # tool: the call answered
    reasoning_content: str | None = None  # assistant: its thinking, for templates that show it

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: object) -> object:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and kind is not None:
                raise ValueError(f"content parts of type {kind!r} are not supported: this "
                                 "model takes text (parts of type 'text', or a string)")
        return content

    @model_validator(mode="after")
    def _fields_of_role(self) -> Self:
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"only assistant messages have {name}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages, and only they, have a tool_call_id (the call "
                             "they answer)")
        if self.content is None:
            if self.role != "assistant" or not self.tool_calls:
                raise ValueError("content is required, unless an assistant message has "
                                 "tool_calls")
            self.content = ""
        return self

    def as_template_dict(self) -> dict[str, object]:
        content = self.content
        assert content is not None  # _fields_of_role fills it in
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, object] = {"role": role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


# Names a chat template is called with by Baton or transformers: not a client's to set.
_TEMPLATE_RESERVED = frozenset(
    "messages conversation tools documents add_generation_prompt continue_final_message "
    "chat_template tokenize return_dict padding truncation max_length return_tensors "
    "return_assistant_tokens_mask tokenizer_kwargs".split())


class Conversation(RequestModel):
    """Messages and tools, what a chat template renders."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    # vLLM's: extra variables for the chat template (`{"enable_thinking": false}`)
    chat_template_kwargs: dict[str, object] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, object] | None) -> dict[str, object] | None:
        for key in kwargs or ():
            if not key.isidentifier() or key in _TEMPLATE_RESERVED:
                raise ValueError(f"chat_template_kwargs cannot set {key!r}: keys are "
                                 "template variables other than "
                                 f"{', '.join(sorted(_TEMPLATE_RESERVED))}")
        return kwargs

    def template_messages(self) -> list[dict[str, object]]:
        return [m.as_template_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, object]] | None:
        """The tools as a template takes them (None without tools, as transformers)."""
        return [t.template_dict() for t in self.tools] if self.tools else None


class ChatCompletionRequest(Conversation, _SamplingFields):
    """POST /v1/chat/completions (text content parts only)."""

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, else none
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """What `tool_choice` means here: given, else `auto` with tools, `none` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def constraints(self) -> dict[str, StructuredOutput]:
        """With a forced tool call's (`tool_choice`); raises ParamError for a `tool_choice`
        the tools cannot satisfy (at parse: a 400)."""
        out = super().constraints()
        schema = forced_schema(self.tools or [], self.effective_tool_choice,
                               self.parallel_tool_calls)
        if schema is not None:
            out["tool_choice"] = StructuredOutput("json_schema", json.dumps(schema))
        return out

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, k)


_Model = TypeVar("_Model", bound=BaseModel)


def parse_request(model: type[_Model], body: bytes) -> _Model:
    """Parse and validate a JSON body, turning every failure into a 400 OpenAIError."""
    try:
        return model.model_validate_json(body)
    except RecursionError:  # JSON text nested deep inside a string: guided_json, arguments
        raise OpenAIError(400, "the body nests too deeply (JSON text in a string field, a "
                               "schema or a tool call's arguments)") from None
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        kind = first["type"]
        if kind == "json_invalid":
            raise OpenAIError(400, f"the body is not valid JSON: {first['msg']}") from None
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, ParamError) and not loc:
            loc = cause.param
        if kind == "extra_forbidden":
            msg = f"unsupported field {loc!r}: Baton does not implement it"
        else:
            text = str(cause) if isinstance(cause, ValueError) else first["msg"]
            msg = f"{loc + ': ' if loc else ''}{text}"
        raise OpenAIError(400, msg, param=loc or None) from None
