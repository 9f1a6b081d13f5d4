"""Llama 3.1 / 3.2 / 3.3 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`
(or "arguments"), several separated by `;`, possibly after `<|python_tag|>` (gone from the
text when special tokens are skipped). Only at the start of the answer, as vLLM: an answer
that starts with prose is prose."""

from __future__ import annotations

from baton.worker.tool_parsers.scanner import Layout
from baton.worker.tool_parsers.sections import SectionParser


class Llama3JsonParser(SectionParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    kept_markers = ("{",)
    anywhere = False
    layout = Layout(separator=";")
