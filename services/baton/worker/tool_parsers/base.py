"""The contract of a tool-call parser: the events it turns a choice's output text into.

A parser reads one choice's output text as it arrives (`feed`, any number of times, then
`finish` once) and returns events: `Content` (text to show as the message's content),
`CallStart` (a call's name, once the text is certainly a call) and `CallArgs` (the next
piece of that call's arguments, as the model wrote them: a call's pieces concatenated are
its `arguments` JSON text). Feeding the whole output at once gives the same events as
feeding it in any pieces, merged: a stream reassembles to the whole answer.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # calls of this choice, in order from 0
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


Event = Content | CallStart | CallArgs


class ToolParser(ABC):
    """One choice's parser; a new one per choice. Called from the event loop only."""

    name: ClassVar[str]
    # Marker tokens the format writes that a tokenizer may call special: with them,
    # requests this parser reads keep special tokens in their text.
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events the next piece of output text completes (possibly none)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The events of whatever is held back, at the end of the output."""

    @staticmethod
    def call_id() -> str:
        """A new call's id, in the shape the format's chat template accepts back."""
        return "call_" + secrets.token_hex(12)


def merged(events: list[Event]) -> list[Event]:
    """Neighbouring content, or pieces of the same call's arguments, as one event."""
    out: list[Event] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + ev.text)
        elif isinstance(ev, CallArgs) and isinstance(last, CallArgs) and \
                last.index == ev.index:
            out[-1] = CallArgs(ev.index, last.text + ev.text)
        else:
            out.append(ev)
    return out


def alphanumeric_id(length: int = 9) -> str:
    """Mistral's call ids: its template accepts 9 letters and digits only."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))
