"""Hermes / Qwen: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
anywhere in the text (Qwen 2.5 / 3, Hermes 2 Pro / 3, SmolLM3, ...)."""

from __future__ import annotations

from baton.worker.tool_parsers.scanner import Layout
from baton.worker.tool_parsers.sections import SectionParser


class HermesParser(SectionParser):
    name = "hermes"
    markers = ("<tool_call>",)
    layout = Layout(end="</tool_call>")
