"""OpenAI response models of /v1/chat/completions and /v1/completions, streamed or whole: what a
worker sends (`worker/openai_api.py`) and what the router writes when it ends a stream a dead
decode pod left open (`router/resume.py`).

Serialised with `dump_sse` / `dump` (unset fields left out, so a choice shows `"logprobs":
null` where it was given as None and a chunk has `usage` only when it carries one), in the
shape OpenAI's clients parse. Built by our own code, so building them is cheap: no field
needs more than its type checked."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from baton.common.internal import StreamHeader

_OUT = ConfigDict(extra="forbid")


class PromptTokensDetails(BaseModel):
    model_config = _OUT
    cached_tokens: int = 0


class Usage(BaseModel):
    model_config = _OUT
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int | None = None) -> Usage:
        """Usage of `prompt` + `completion` tokens; `cached` prompt tokens when known."""
        details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
        if details is None:
            return cls(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion)
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion, prompt_tokens_details=details)


class TopLogprob(BaseModel):
    model_config = _OUT
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    model_config = _OUT
    content: list[ChatTokenLogprob]
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    model_config = _OUT
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    """A tool call's function; in a stream delta, the part this chunk adds."""

    model_config = _OUT
    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    """A tool call of a whole message, or (with `index`) one call's part in a delta."""

    model_config = _OUT
    index: int | None = None
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatDelta(BaseModel):
    model_config = _OUT
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (vLLM's name)
    tool_calls: list[ToolCall] | None = None


class ChatMessage(BaseModel):
    model_config = _OUT
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # set only by a worker with a reasoning parser
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"] | None


class ChatChunkChoice(BaseModel):
    model_config = _OUT
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatChoice(BaseModel):
    model_config = _OUT
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class TextChoice(BaseModel):
    """A completion's choice, whole or a stream chunk's (the same shape)."""

    model_config = _OUT
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class TTFTBreakdown(BaseModel):
    """Seconds of a request's time to first token, when asked for (`X-Baton-Timing`)."""

    model_config = _OUT
    router_queue_s: float
    prefill_s: float
    decode_queue_s: float
    first_token_s: float
    total_s: float
    transfer_s: float  # the KV pull, off the TTFT path


class OpenAIResponse(BaseModel):
    model_config = _OUT
    id: str
    object: str
    created: int
    model: str
    usage: Usage | None = None
    baton_ttft: TTFTBreakdown | None = None  # Baton's: only when asked for

    def dump(self) -> dict[str, Any]:  # JSON
        return self.model_dump(mode="json", exclude_unset=True)

    def dump_sse(self) -> bytes:
        return b"data: " + self.model_dump_json(exclude_unset=True).encode() + b"\n\n"


class ResponseChunk(OpenAIResponse):
    """One streamed event of either API (chat.completion.chunk or text_completion)."""

    choices: list[ChatChunkChoice] | list[TextChoice]

    @classmethod
    def of(cls, header: StreamHeader, choices: list[ChatChunkChoice] | list[TextChoice],
           usage: Usage | None = None) -> ResponseChunk:
        if usage is None:
            return cls(id=header.id, object=header.object, created=header.created,
                       model=header.model, choices=choices)
        return cls(id=header.id, object=header.object, created=header.created,
                   model=header.model, choices=choices, usage=usage)


class ChatCompletion(OpenAIResponse):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class Completion(OpenAIResponse):
    object: Literal["text_completion"]
    choices: list[TextChoice]
