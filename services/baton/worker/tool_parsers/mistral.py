"""Mistral (v0.3 tokenizer and its template): `[TOOL_CALLS]` then a JSON array of
`{"name": ..., "arguments": {...}}`. `[TOOL_CALLS]` is a special token, so the requests it
reads keep special tokens in their text; the template accepts back only call ids of 9
letters and digits."""

from __future__ import annotations

from baton.worker.tool_parsers.base import alphanumeric_id
from baton.worker.tool_parsers.sections import SectionParser


class MistralParser(SectionParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True

    @staticmethod
    def call_id() -> str:
        return alphanumeric_id(9)
