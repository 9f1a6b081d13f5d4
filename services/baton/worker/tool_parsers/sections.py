"""The machinery of the formats that mark their calls in the text (`hermes`,
`llama3_json`, `mistral`, and the forced `required` array).

Content passes through until a marker opens a call section; meanwhile text that may be the
start of a marker, and trailing whitespace, are held back. The section's JSON is read by
`scanner.Section`; one that turns out not to be calls before any of them was certain goes
out as content after all. Whitespace around calls is dropped.
"""

from __future__ import annotations

from typing import ClassVar

from baton.worker.tool_parsers.base import Content, Event, ToolParser, merged
from baton.worker.tool_parsers.scanner import Layout, Section


class SectionParser(ToolParser):
    """Content with call sections opened by `markers`; `kept_markers` are a section's own
    first characters (Llama's bare `{`). `anywhere`: a section may start after content
    (else only at the start of the output)."""

    markers: ClassVar[tuple[str, ...]] = ()
    kept_markers: ClassVar[tuple[str, ...]] = ()
    anywhere: ClassVar[bool] = True
    layout: ClassVar[Layout] = Layout()

    def __init__(self) -> None:
        self._pending = ""  # content held back: a possible marker, trailing whitespace
        self._section: Section | None = None
        self._calls = 0
        self._content_seen = False  # content went out (and sections may be over)
        self._after_section = False  # content right after a section drops leading space

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        self._feed(text, events)
        return merged(events)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        while self._section is not None:
            section, self._section = self._section, None
            if not section.committed:  # never certainly calls: it was content
                self._feed(self._reverted(section, events), events)
        tail, self._pending = self._pending, ""
        self._emit(tail.strip() if self._calls else tail, events)
        return merged(events)

    def _feed(self, text: str, events: list[Event]) -> None:
        while text:
            if self._section is None:
                text = self._content(text, events)
            else:
                text = self._in_section(text, events)

    # -- content ---------------------------------------------------------------------------
    def _content(self, text: str, events: list[Event]) -> str:
        """Take content from `text` up to a marker; returns the text after the marker, for
        the section it opened ("" when all of it was content or is held back)."""
        pending = self._pending + text
        self._pending = ""
        found = self._find_marker(pending)
        if found is not None:
            at, marker = found
            shown = pending[:at].rstrip()
            self._emit(shown, events)
            self._section = Section(self.layout, self._next_index, marker,
                                    before=pending[len(shown):at])
            kept = marker if marker in self.kept_markers else ""
            return kept + pending[at + len(marker):]
        shown = pending[:len(pending) - self._held(pending)].rstrip()
        self._emit(shown, events)
        self._pending = pending[len(shown):]
        return ""

    def _find_marker(self, text: str) -> tuple[int, str] | None:
        """The first marker in `text` and where it starts, if any."""
        if not self.anywhere:
            if self._content_seen:
                return None
            start = len(text) - len(text.lstrip())
            return next(((start, m) for m in self.markers if text.startswith(m, start)),
                        None)
        hits = [(text.find(m), m) for m in self.markers if m in text]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """How much of the end of `text` may begin a marker (and is held back)."""
        if not self.anywhere:
            head = text.lstrip()
            maybe = not self._content_seen and any(m.startswith(head) for m in self.markers)
            return len(text) if maybe else 0
        for n in range(min(len(text), max(map(len, self.markers)) - 1), 0, -1):
            if any(m.startswith(text[-n:]) for m in self.markers):
                return n
        return 0

    def _emit(self, text: str, events: list[Event]) -> None:
        if self._after_section:
            text = text.lstrip()
        if text:
            events.append(Content(text))
            self._content_seen = True
            self._after_section = False

    # -- sections --------------------------------------------------------------------------
    def _next_index(self) -> int:
        self._calls += 1
        return self._calls - 1

    def _in_section(self, text: str, events: list[Event]) -> str:
        """Feed the open section; returns the text after it once it ends."""
        section = self._section
        assert section is not None  # _feed calls this while a section is open
        rest = section.feed(text, events)
        if section.failed and not section.committed:
            self._section = None
            return self._reverted(section, events) + rest
        if section.done or section.failed:  # a failure after a call: the rest is content
            self._section = None
            self._after_section = self._content_seen = True
            return rest
        return ""

    def _reverted(self, section: Section, events: list[Event]) -> str:
        """A section that was content after all: its marker goes out as content; returns
        the text it had consumed, to read again as content."""
        if section.marker in self.kept_markers:
            self._content_seen = True  # sections only open at the start
            self._emit(section.before, events)
        else:
            self._emit(section.before + section.marker, events)
        return section.raw
