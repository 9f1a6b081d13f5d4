"""The OpenAI request shapes Baton accepts, shared by the router and the workers (no torch).

Requests are parsed strictly: a wrong JSON type is an error (no "0.5" -> 0.5 coercion) and
a field we do not implement is rejected with a 400 that names it, never silently ignored.
Beyond OpenAI's fields we take vLLM's usual extras (`top_k`, `min_p`, `min_tokens`,
`ignore_eos`, `repetition_penalty`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`) under the same names.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from baton.common.errors import OpenAIError
from baton.common.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

MAX_LOGPROBS = 20
MAX_STOP = 256  # stop strings, and stop token ids: each is checked on every token
MAX_STOP_CHARS = 4096
# Strict types, and no NaN / Infinity (JSON's extensions): a non-finite float is a 400.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields common to both endpoints."""

    model_config = _STRICT
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

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed,
                max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                skip_special_tokens=self.skip_special_tokens)
        except ValueError as err:
            field = str(err).split("=", 1)[0].removeprefix("SamplingParams.")
            raise OpenAIError(400, str(err), param=field) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is a string, a list of strings, a list of token ids,
    or a list of token-id lists; several prompts give `len(prompts) * n` choices."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs prompt logprobs, which Baton does not "
                             "compute; drop one of them")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions (text content parts only)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, k)


def parse_request(model: type[BaseModel], body: bytes):
    """Parse and validate a JSON body, turning every failure into a 400 OpenAIError."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        kind = first["type"]
        if kind == "json_invalid":
            raise OpenAIError(400, f"the body is not valid JSON: {first['msg']}") from None
        if kind == "extra_forbidden":
            msg = f"unsupported field {loc!r}: Baton does not implement it"
        else:
            msg = f"{loc + ': ' if loc else ''}{first['msg']}"
        raise OpenAIError(400, msg, param=loc or None) from None
