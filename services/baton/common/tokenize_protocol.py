"""vLLM's `/tokenize` and `/detokenize` bodies (no torch): a prompt, or messages through the
chat template; token ids back to text."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field

from baton.common.protocol import Conversation, parse_request
from baton.common.request_model import RequestModel


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Conversation):
    model: str | None = None
    add_special_tokens: Literal[False] = False  # the template writes the special tokens
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=1 << 31)]]


TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    """A /tokenize body: messages (chat, through the template) or a prompt."""
    try:
        chat = "messages" in json.loads(body)
    except (ValueError, TypeError):
        chat = False  # parse_request names the problem
    if chat:
        return parse_request(TokenizeChatRequest, body)
    return parse_request(TokenizeCompletionRequest, body)
