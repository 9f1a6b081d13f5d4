"""Reading a section of JSON tool calls as it arrives, one character at a time.

A section holds one call object, or a JSON array of them, or calls separated by
`Layout.separator`, then optionally `Layout.end`. A call object is
`{"name": "<function>", "arguments" | "parameters": <value>}` (also `"type"` / `"id"`
keys). A call is certain — its `CallStart` goes out — once its name is known and its
arguments value begins (or its object closes with a name): after that its arguments
stream as `CallArgs`, the value's own characters as the model wrote them. Before that,
anything else (an unknown key, text that is not JSON) fails the section, and the format's
parser shows its text as content instead.

Not a full JSON validator: strings, nesting and the characters allowed outside strings
are checked, which is what tells a call from prose.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from baton.common.tools import ARGUMENT_KEYS
from baton.worker.tool_parsers.base import CallArgs, CallStart, Event

_WS = " \t\r\n"
_SCALAR = set("0123456789-+.eE" "truefalsn")  # numbers, true, false, null
_OUTSIDE_STRINGS = set(_WS + ",:") | _SCALAR
_CALL_KEYS = ("name", "type", "id") + ARGUMENT_KEYS


@dataclass(frozen=True)
class Layout:
    end: str = ""  # closes the section after its calls (Hermes: "</tool_call>")
    separator: str = ""  # between calls outside an array (Llama 3: ";")


class NotACall(Exception):
    """The text stopped being a call (internal to the scanner)."""


class _Value:
    """The extent of one JSON value: `feed` says whether a character belongs to it."""

    def __init__(self) -> None:
        self.kind = ""  # container, string or scalar, from its first character
        self.depth = 0
        self.in_string = self.escaped = self.done = False

    def feed(self, ch: str) -> bool:
        if not self.kind:
            self._start(ch)
        elif self.kind == "scalar":
            if ch not in _SCALAR:
                self.done = True
                return False
        elif self.in_string:
            self._string_char(ch)
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        elif ch not in _OUTSIDE_STRINGS:
            raise NotACall(f"{ch!r} outside a JSON string")
        return True

    def _start(self, ch: str) -> None:
        if ch in "{[":
            self.kind, self.depth = "container", 1
        elif ch == '"':
            self.kind, self.in_string = "string", True
        elif ch in _SCALAR:
            self.kind = "scalar"
        else:
            raise NotACall(f"{ch!r} cannot start a JSON value")

    def _string_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            self.done = self.kind == "string"


class _CallObject:
    """One call object, from after its `{` to its `}` (`done`)."""

    def __init__(self, next_index: Callable[[], int], events: list[Event]) -> None:
        self.next_index = next_index
        self.events = events
        self.state = "key_or_end"
        self.key = ""  # the key being read, then the key of the value being read
        self.value: _Value | None = None
        self.text = ""  # the current value's text (names and held-back arguments)
        self.name: str | None = None
        self.held_args: str | None = None  # arguments read before the name
        self.index: int | None = None  # set once the call is certain
        self.args_seen = self.done = self.escaped = False

    @property
    def committed(self) -> bool:
        return self.index is not None

    def feed(self, ch: str) -> None:
        state = self.state
        if state == "value":
            return self._value_char(ch)
        if ch in _WS and state != "key":
            return None
        if state == "key":
            self._key_char(ch)
        elif state in ("key_or_end", "next_key") and ch == '"':
            self.state, self.text = "key", ""
        elif state in ("key_or_end", "after_value") and ch == "}":
            self._close()
        elif state == "after_value" and ch == ",":
            self.state = "next_key"
        elif state == "colon" and ch == ":":
            self.state, self.value = "value", _Value()
        else:
            raise NotACall(f"{ch!r} where a call object has {state.replace('_', ' ')}")
        return None

    def _key_char(self, ch: str) -> None:
        if ch == '"' and not self.escaped:
            self.key, self.state = self.text, "colon"
            if self.key not in _CALL_KEYS and not self.committed:
                raise NotACall(f"key {self.key!r} in what looked like a call")
        else:
            self.escaped = ch == "\\" and not self.escaped
            self.text += ch

    def _value_char(self, ch: str) -> None:
        value, key = self.value, self.key
        assert value is not None  # set with the "value" state
        if not value.kind and ch in _WS:
            return
        if not value.kind:
            self.text = ""
            if key == "name" and ch != '"':
                raise NotACall("a call's name is a string")
            if key in ARGUMENT_KEYS and not self.args_seen and self.name is not None:
                self._commit()
        consumed = value.feed(ch)
        if consumed:
            self._value_text(ch)
        if value.done:
            self._value_done()
            if not consumed:
                self.feed(ch)

    def _value_text(self, ch: str) -> None:
        # `self.index is not None`: self.committed, spelled out for the type checker
        if self.key in ARGUMENT_KEYS and not self.args_seen and self.index is not None:
            self.events.append(CallArgs(self.index, ch))
        else:
            self.text += ch

    def _value_done(self) -> None:
        self.state = "after_value"
        if self.key == "name" and self.name is None:
            self.name = _string(self.text)
            if self.held_args is not None:
                self._commit()
        elif self.key in ARGUMENT_KEYS and not self.args_seen:
            self.args_seen = True
            if not self.committed:
                self.held_args = self.text

    def _close(self) -> None:
        if self.name is None:
            raise NotACall("a call object without a name")
        if not self.committed:
            index = self._commit()
            if self.held_args is None:
                self.events.append(CallArgs(index, "{}"))
        self.done = True

    def _commit(self) -> int:
        """Makes the call certain; its index."""
        assert self.name is not None  # each caller has checked or just set the name
        index = self.index = self.next_index()
        self.events.append(CallStart(index, self.name))
        if self.held_args is not None:
            self.events.append(CallArgs(index, self.held_args))
        return index


def _string(text: str) -> str:
    try:
        return json.loads(text)
    except ValueError:
        raise NotACall("a call's name is not a JSON string") from None


class Section:
    """One call section, from after its marker: `feed` it text until it is `done` (its
    calls read; the text after it is returned) or `failed` (the text from where it stopped
    being calls is returned). `raw` is the text it consumed; `committed`: one of its calls
    is certain."""

    def __init__(self, layout: Layout, next_index: Callable[[], int], marker: str,
                 before: str = "") -> None:
        self.layout = layout
        self.next_index = next_index
        self.marker, self.before = marker, before  # before: the whitespace it dropped
        self.state = "start"
        self.in_array = False
        self.call: _CallObject | None = None
        self.raw = ""
        self.end_matched = 0  # characters of layout.end matched so far
        self.done = self.failed = False
        self._earlier = False  # an earlier call of the section is certain

    @property
    def committed(self) -> bool:
        return self._earlier or (self.call is not None and self.call.committed)

    def feed(self, text: str, events: list[Event]) -> str:
        if self.call is not None:
            self.call.events = events  # where this feed's events go
        for i, ch in enumerate(text):
            try:
                consumed = self._char(ch, events)
            except NotACall:
                self.failed = True
                return text[i:]
            if self.done:
                if consumed:
                    return text[i + 1:]
                return self.layout.end[:self.end_matched] + text[i:]
            self.raw += ch
        return ""

    def _char(self, ch: str, events: list[Event]) -> bool:
        """Take one character; False when the section ended before it."""
        state = self.state
        if state == "call":
            assert self.call is not None  # set with the "call" state
            self.call.feed(ch)
            if self.call.done:
                self.state = "after_call"
            return True
        if state == "end":
            return self._end_char(ch)
        if ch in _WS:
            return True
        if ch == "{" and state in ("start", "first_call", "next_call"):
            self._earlier = self.committed
            self.call, self.state = _CallObject(self.next_index, events), "call"
        elif ch == "[" and state == "start":
            self.in_array, self.state = True, "first_call"
        elif ch == "," and state == "after_call" and self.in_array:
            self.state = "next_call"
        elif ch == "]" and self.in_array and state in ("first_call", "after_call"):
            self.in_array, self.state = False, "after_array"
        elif ch == self.layout.separator and state == "after_call" and not self.in_array:
            self.state = "next_call"
        elif state in ("after_call", "after_array") and not self.in_array:
            if self.layout.end and ch == self.layout.end[0]:
                self.state = "end"
                return self._end_char(ch)
            self.done = True
            return False
        else:
            raise NotACall(f"{ch!r} where a call section has {state.replace('_', ' ')}")
        return True

    def _end_char(self, ch: str) -> bool:
        end = self.layout.end
        if ch != end[self.end_matched]:
            self.done = True
            return False
        self.end_matched += 1
        if self.end_matched == len(end):
            self.done, self.end_matched = True, 0
        return True
