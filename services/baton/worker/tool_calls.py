"""A chat choice's tool calls in OpenAI's shapes, from its parser's events.

    ToolFormat (one per worker: the `--tool-call-parser` format) -> ChoiceTools (one per
    choice of a request with tools) -> stream deltas, or the whole message

Which parser reads a choice: a forced `tool_choice` generates what `common.tools`
constrained it to (`NamedCallParser`, `RequiredCallsParser`); `auto` is read with the
worker's format; `none` (or no tools) is not read at all. Streamed, a call is one delta
with its `index`, `id`, `type`, `function.name` and empty `arguments`, then deltas with
pieces of its arguments, as OpenAI sends them; the text of a call never shows as content.
Whole, the same events give the message's `content` (null when there are calls and no
other text) and `tool_calls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest
from baton.common.tools import NamedToolChoice
from baton.worker.tool_parsers import (
    CallArgs,
    CallStart,
    Content,
    Event,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
    resolve,
)


class ToolFormat:
    """The worker's tool-call format: `name` is `--tool-call-parser` (`auto` reads the
    chat template)."""

    def __init__(self, name: str, chat_template: object) -> None:
        self.parser = resolve(name, chat_template)  # None: `none`, auto calls refused

    def check(self, request: ChatCompletionRequest) -> None:
        """Raises a 400 OpenAIError if this worker cannot read the request's tool calls."""
        if request.effective_tool_choice == "auto" and self.parser is None:
            raise OpenAIError(400, "tool_choice 'auto' needs a tool-call parser, and this "
                                   "worker runs with --tool-call-parser none; force the "
                                   "call (tool_choice 'required' or a named function) or "
                                   "send tool_choice 'none'", param="tool_choice")

    def keeps_special_tokens(self, request: ChatCompletionRequest) -> bool:
        """Whether the request's text must keep special tokens for its calls to be read
        (a marker the tokenizer calls special, as Mistral's `[TOOL_CALLS]`)."""
        return (request.effective_tool_choice == "auto" and self.parser is not None
                and self.parser.keeps_special_tokens)

    def choice_tools(self, request: ChatCompletionRequest) -> ChoiceTools | None:
        """A new reader of one choice's calls; None when the request's calls are not read."""
        choice = request.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            parser: ToolParser = NamedCallParser(choice.function.name)
        elif choice == "required":
            parser = RequiredCallsParser()
        elif choice == "auto" and self.parser is not None:
            parser = self.parser()
        else:
            return None
        ids = self.parser or ToolParser  # ids in the shape the template takes back
        return ChoiceTools(parser, ids.call_id, request.parallel_tool_calls)


class ChoiceTools:
    """One choice's content and calls so far."""

    def __init__(self, parser: ToolParser, new_id: Callable[[], str], parallel: bool) -> None:
        self.parser = parser
        self.new_id = new_id
        self.parallel = parallel
        self.content = ""
        self.calls: list[dict] = []

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The stream deltas of the next piece of output text (and of the end, once
        `finished`), in order: `{"content": ...}` or `{"tool_calls": [one call's part]}`."""
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        out: list[dict] = []
        for ev in events:
            delta = self._delta(ev)
            if delta is not None:
                out.append(delta)
        return out

    def message(self, text: str) -> dict:
        """The whole message's `content` and `tool_calls`, from the whole output text."""
        self.deltas(text, finished=True)
        if not self.calls:
            return {"content": self.content}
        return {"content": self.content or None, "tool_calls": self.calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for an answer that ended with calls made."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _delta(self, ev: Event) -> dict | None:
        if isinstance(ev, Content):
            self.content += ev.text
            return {"content": ev.text}
        if ev.index > 0 and not self.parallel:
            return None  # parallel_tool_calls false: the first call only
        if isinstance(ev, CallStart):
            call: dict[str, Any] = {"id": self.new_id(), "type": "function",
                    "function": {"name": ev.name, "arguments": ""}}
            self.calls.append(call)
            return {"tool_calls": [{"index": ev.index, **call,
                                    "function": dict(call["function"])}]}
        return self._arguments(ev)

    def _arguments(self, ev: CallArgs) -> dict:
        self.calls[ev.index]["function"]["arguments"] += ev.text
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
