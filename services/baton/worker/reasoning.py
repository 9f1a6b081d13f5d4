"""Reasoning models: a chat choice's thinking split from its answer (`--reasoning-parser`).

    ReasoningFormat (one per worker) -> ThinkingSplitter (one per choice that thinks)
    -> (REASONING | CONTENT, text) pieces -> `reasoning_content` / content deltas

Both formats write the thinking as `<think>...</think>` before the answer:

- `qwen3` (Qwen3, QwQ): the answer starts in thinking unless the request's
  `chat_template_kwargs` has `enable_thinking: false` (the template then closes an empty
  thinking block in the prompt), as vLLM's parser reads it.
- `deepseek_r1` (DeepSeek-R1 and its distills): always starts in thinking (the template
  opens `<think>` in the prompt).
- `auto` picks from the chat template: `deepseek_r1` for DeepSeek's, `qwen3` for another
  that handles `<think>`, none for one that does not.

A choice that starts in thinking drops a `<think>` the model writes first (older templates
leave it to the model); everything before `</think>` is reasoning, everything after it the
answer, which alone is read for tool calls (`tool_calls.py`). An answer that never closes
its thinking (cut by `max_tokens`) is all reasoning, as vLLM has it. The markers are read in
the text, so they must be tokens that `skip_special_tokens` keeps (they are in these models'
tokenizers). Structured outputs and forced tool calls apply to the answer only: the
request's grammar starts after the `</think>` token (`StructuredOutput.after_token`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from baton.common.protocol import ChatCompletionRequest
from baton.common.sampling_params import SamplingParams
from baton.worker.tool_calls import ChoiceTools

REASONING_PARSERS = ("qwen3", "deepseek_r1")
REASONING_PARSER_CHOICES = ("none", "auto", *REASONING_PARSERS)  # --reasoning-parser
THINK_START, THINK_END = "<think>", "</think>"
REASONING: Literal["reasoning"] = "reasoning"
CONTENT: Literal["content"] = "content"
Piece = tuple[Literal["reasoning", "content"], str]


def resolve(name: str, chat_template: object) -> str | None:
    """The format `--reasoning-parser name` means for this template; None for `none` (or
    `auto` over a template without thinking). Raises ValueError naming the choices."""
    if name not in REASONING_PARSER_CHOICES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{REASONING_PARSER_CHOICES}")
    if name != "auto":
        return None if name == "none" else name
    text = chat_template if isinstance(chat_template, str) else ""
    if THINK_START not in text:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in text else "qwen3"


class ReasoningFormat:
    """The worker's reasoning format over its tokenizer. Raises ValueError when the
    format is on and `</think>` is not one token of the vocabulary (the grammar of a
    structured output waits for that token)."""

    def __init__(self, name: str, tokenizer) -> None:
        self.name = resolve(name, getattr(tokenizer, "chat_template", None))
        self.end_token_id: int | None = None
        if self.name is not None:
            ids = tokenizer.encode(THINK_END, add_special_tokens=False) \
                if tokenizer is not None else []
            if len(ids) != 1:
                raise ValueError(f"--reasoning-parser {self.name} needs {THINK_END!r} as one "
                                 f"token of the model's vocabulary; this tokenizer makes "
                                 f"{len(ids)} of it")
            self.end_token_id = ids[0]

    def thinks(self, request: ChatCompletionRequest) -> bool:
        """Whether the request's answer starts in thinking."""
        if self.name is None:
            return False
        if self.name == "qwen3":
            return (request.chat_template_kwargs or {}).get("enable_thinking") is not False
        return True

    def sampling_params(self, request: ChatCompletionRequest,
                        params: SamplingParams) -> SamplingParams:
        """`params` with its output constraint starting after the thinking, when the
        request thinks."""
        if params.structured is None or not self.thinks(request):
            return params
        return replace(params, structured=replace(params.structured,
                                                  after_token=self.end_token_id))

    def splitter(self, request: ChatCompletionRequest) -> ThinkingSplitter | None:
        """A new reader of one choice's thinking; None when the request does not think."""
        return ThinkingSplitter() if self.thinks(request) else None


class ThinkingSplitter:
    """One choice's output text, as it arrives, split into reasoning and answer pieces.
    Text that may be the start of a marker is held back until the next piece tells."""

    def __init__(self) -> None:
        self.thinking = True
        self._at_start = True  # nothing shown yet: a `<think>` here is dropped
        self._held = ""

    def feed(self, text: str, finished: bool = False) -> list[Piece]:
        """The pieces the next output text completes (and, once `finished`, all the rest),
        in order, none empty."""
        if not self.thinking:
            return [(CONTENT, text)] if text else []
        text, self._held = self._held + text, ""
        if self._at_start:
            if len(text) < len(THINK_START) and THINK_START.startswith(text) \
                    and not finished:
                self._held = text
                return []
            self._at_start = False
            text = text.removeprefix(THINK_START)
        end = text.find(THINK_END)
        if end >= 0:
            self.thinking = False
            return _pieces((REASONING, text[:end]), (CONTENT, text[end + len(THINK_END):]))
        keep = 0 if finished else _partial_marker(text, THINK_END)
        self._held = text[len(text) - keep:]
        return _pieces((REASONING, text[:len(text) - keep]))

    def split(self, text: str) -> tuple[str, str]:
        """A whole output's (reasoning, answer)."""
        pieces = self.feed(text, finished=True)
        return ("".join(t for k, t in pieces if k == REASONING),
                "".join(t for k, t in pieces if k == CONTENT))


def _pieces(*pieces: Piece) -> list[Piece]:
    return [p for p in pieces if p[1]]


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def chat_deltas(text: str, finished: bool, tools: ChoiceTools | None,
                thinking: ThinkingSplitter | None) -> list[dict]:
    """A chat choice's stream deltas for its next output text (and its end, once
    `finished`): `{"reasoning_content": ...}` for thinking, the answer's as `tool_calls.py`
    reads it (`{"content": ...}` without tools)."""
    pieces = thinking.feed(text, finished) if thinking is not None else _pieces((CONTENT, text))
    out: list[dict] = []
    for kind, piece in pieces:
        if kind == REASONING:
            out.append({"reasoning_content": piece})
        elif tools is not None:
            out += tools.deltas(piece, False)
        else:
            out.append({"content": piece})
    if finished and tools is not None:
        out += tools.deltas("", True)
    return out


def chat_message(text: str, tools: ChoiceTools | None,
                 thinking: ThinkingSplitter | None) -> dict:
    """A whole chat message's `content`, `tool_calls` and `reasoning_content` (null content
    when a thinking answer has no other text, as vLLM)."""
    reasoning, answer = thinking.split(text) if thinking is not None else ("", text)
    message = tools.message(answer) if tools is not None else {"content": answer}
    if thinking is not None:
        message["reasoning_content"] = reasoning or None
        message["content"] = message["content"] or None
    return message
