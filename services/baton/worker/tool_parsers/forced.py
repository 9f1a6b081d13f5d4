"""The output of a forced call, constrained by `common.tools.forced_schema`: with
`tool_choice` naming a function, the whole output is its arguments object; with
`required`, a JSON array of `{"name": ..., "parameters": {...}}`."""

from __future__ import annotations

from baton.worker.tool_parsers.base import CallArgs, CallStart, Event, ToolParser
from baton.worker.tool_parsers.sections import SectionParser


class NamedCallParser(ToolParser):
    """One call of `function`, whose arguments are the whole output (whitespace around
    it dropped)."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function
        self._started = self._sent_any = False
        self._held = ""  # trailing whitespace, shown once more arguments follow

    def feed(self, text: str) -> list[Event]:
        events = self._start()
        text = self._held + text if self._sent_any else text.lstrip()
        shown = text.rstrip()
        self._held = text[len(shown):]
        if shown:
            self._sent_any = True
            events.append(CallArgs(0, shown))
        return events

    def finish(self) -> list[Event]:
        return self._start()

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [CallStart(0, self.function)]


class RequiredCallsParser(SectionParser):
    """The array of calls `required` generates: one section from the first character."""

    name = "required"
    markers = kept_markers = ("",)
    anywhere = False
