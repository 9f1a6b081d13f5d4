"""Tool-call parsers: a choice's output text -> content and tool calls (`base.ToolParser`).

    base.py         the contract: `feed` / `finish` -> Content, CallStart, CallArgs events
    scanner.py      JSON call objects read one character at a time (`Section`)
    sections.py     content with marked call sections, shared by the formats below
    hermes.py       <tool_call>{...}</tool_call>        (Qwen, Hermes)
    llama3_json.py  {"name": ..., "parameters": ...}     (Llama 3.x)
    mistral.py      [TOOL_CALLS][{...}, ...]             (Mistral)
    forced.py       what a forced `tool_choice` generates (named, required)

A worker reads `tool_choice: auto` answers with one format (`--tool-call-parser`); `auto`
picks it from the chat template's text.
"""

from __future__ import annotations

from baton.worker.tool_parsers.base import CallArgs, CallStart, Content, Event, ToolParser
from baton.worker.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from baton.worker.tool_parsers.hermes import HermesParser
from baton.worker.tool_parsers.llama3_json import Llama3JsonParser
from baton.worker.tool_parsers.mistral import MistralParser

__all__ = ["PARSERS", "PARSER_CHOICES", "CallArgs", "CallStart", "Content", "Event",
           "NamedCallParser", "RequiredCallsParser", "ToolParser", "detect", "resolve"]

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser)}
PARSER_CHOICES = ("auto", *PARSERS, "none")  # what --tool-call-parser takes
# What in a chat template tells its format, first match wins; none: hermes.
_TEMPLATE_SIGNS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
                   ("<|python_tag|>", "llama3_json"), ("<|start_header_id|>", "llama3_json"))


def detect(chat_template: object) -> str:
    """The format a chat template writes calls in (hermes when it does not tell)."""
    text = chat_template if isinstance(chat_template, str) else ""
    return next((name for sign, name in _TEMPLATE_SIGNS if sign in text), "hermes")


def resolve(name: str, chat_template: object) -> type[ToolParser] | None:
    """The parser class `--tool-call-parser name` means for this template; None for
    `none`. Raises ValueError naming the choices for an unknown name."""
    if name == "none":
        return None
    if name == "auto":
        name = detect(chat_template)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{PARSER_CHOICES}")
    return PARSERS[name]
