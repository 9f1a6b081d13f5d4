"""Incremental detokenisation equals a full decode, and stop strings cut the text exactly."""

from __future__ import annotations

import pytest

from baton.engine.tokenizer import IncrementalDetokenizer

TEXT = ("Hello, world! Ünïcödé ☃ and emoji 🎉 work; stop here: END of the line.\n"
        "  Indented code() { return 42; }")


@pytest.fixture
def ids(tokenizer):
    return tokenizer.encode(TEXT)


def stream(tokenizer, ids, stop=(), include=False):
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), list(stop), include, True)
    pieces, matched = [], None
    for t in ids:
        delta, matched = d.add(t)
        pieces.append(delta)
        if matched:
            break
    pieces.append(d.flush())
    return "".join(pieces), matched, d.text


def test_incremental_text_equals_full_decode(tokenizer, ids):
    text, matched, _ = stream(tokenizer, ids)
    assert matched is None
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop,include", [("END", False), ("END", True), ("42;", False),
                                          ("o, w", False), ("🎉", False)])
def test_stop_string_cuts_exactly(tokenizer, ids, stop, include):
    full = tokenizer.decode(ids, skip_special_tokens=True)
    text, matched, final = stream(tokenizer, ids, [stop, "never-there"], include)
    cut = full.index(stop) + (len(stop) if include else 0)
    assert matched == stop
    assert text == final == full[:cut]


def test_earliest_of_several_stop_strings_wins(tokenizer, ids):
    text, matched, _ = stream(tokenizer, ids, ["code", "world"])
    assert matched == "world" and text == "Hello, "
