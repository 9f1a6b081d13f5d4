"""An input-grounded workload: chat requests that hand the model a passage — Python source
from the standard library, or its documentation — and ask for an edit, a reformatting or a
quotation of it, so that much of the answer repeats the prompt (what speculative decoding
by prompt lookup serves). Seeded; offline everywhere (the passages come from the installed
standard library)."""

from __future__ import annotations

import inspect
import pydoc
from dataclasses import dataclass

import numpy as np

_MODULES = ("argparse", "asyncio.queues", "collections", "contextlib", "dataclasses",
            "functools", "json.decoder", "logging", "pathlib", "shlex", "textwrap",
            "string", "fractions", "heapq", "bisect", "calendar")
_CODE_ASKS = ("Add a docstring to every function in this code and return the whole code:",
              "Rename the variable names in this code to longer, clearer ones and return "
              "the whole code:",
              "Return this code unchanged except for type hints on every function:",
              "Copy this code exactly and add a comment above each block:")
_TEXT_ASKS = ("Quote the passage below word for word, then summarise it in one sentence:",
              "Fix the grammar of this passage and return all of it:",
              "Rewrite this passage in British spelling, keeping everything else:")


@dataclass(frozen=True)
class GroundedRequest:
    messages: list[dict[str, str]]
    max_tokens: int


def _passages(rng: np.random.Generator, count: int, chars: tuple[int, int]) -> list[tuple[str, bool]]:
    """(`count` passages of chars[0]..chars[1] characters, whether each is code)."""
    sources = []
    for name in _MODULES:
        module = pydoc.locate(name)
        try:
            sources.append((inspect.getsource(module), True))  # type: ignore[arg-type]
        except (TypeError, OSError):
            pass
        sources.append((pydoc.getdoc(module) or "", False))
    sources = [(s, code) for s, code in sources if len(s) > chars[1]]
    out = []
    for _ in range(count):
        text, code = sources[int(rng.integers(len(sources)))]
        length = int(rng.integers(chars[0], chars[1]))
        # a passage as people paste one: from a definition (code) or a paragraph (text)
        marks = [i + 1 for i in range(len(text) - length)
                 if text.startswith(("\ndef ", "\nclass ", "\n    def ") if code else "\n\n", i)]
        start = marks[int(rng.integers(len(marks)))] if marks else 0
        end = text.rfind("\n", start, start + length)  # whole lines
        out.append((text[start:end if end > start else start + length].strip("\n"), code))
    return out


def grounded_message(rng: np.random.Generator, passage_chars: tuple[int, int]) -> str:
    """One user message: an ask to edit, reformat or quote, and its passage."""
    (passage, code), = _passages(rng, 1, passage_chars)
    asks = _CODE_ASKS if code else _TEXT_ASKS
    ask = asks[int(rng.integers(len(asks)))]
    return f"{ask}\n\n```python\n{passage}\n```" if code else f"{ask}\n\n{passage}"


def grounded_workload(num_requests: int = 32, seed: int = 0,
                      output_tokens: tuple[int, int] = (100, 400),
                      passage_chars: tuple[int, int] = (600, 1600)) -> list[GroundedRequest]:
    """`num_requests` chat requests, each a passage and an ask to edit, reformat or quote
    it, with `max_tokens` drawn uniformly from `output_tokens`."""
    rng = np.random.default_rng(seed)
    return [GroundedRequest([{"role": "user", "content": grounded_message(rng, passage_chars)}],
                            int(rng.integers(output_tokens[0], output_tokens[1] + 1)))
            for _ in range(num_requests)]
