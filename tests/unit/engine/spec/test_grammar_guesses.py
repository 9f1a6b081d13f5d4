"""Guesses of a constrained request (`structured.masks`): cut where the grammar rejects
them (after the start token of a grammar that waits for it), each verification row masked
by a copy of the grammar advanced over the guesses before it (the request's own matcher
does not move), and the tokens a request keeps advance its grammar, the run cut where
the output completes. With llguidance's matchers and with the test fakes."""

from __future__ import annotations

import pytest
import torch

from baton import SamplingParams
from baton.common.sampling_params import StructuredOutput
from baton.engine.request import Request
from baton.engine.structured.masks import (
    advance_grammars,
    fill_grammar_masks,
    guesses_allowed,
    keep_bits,
)
from tests.unit.engine.test_structured import AllowBackend, RecordingMatcher
from tests.unit.engine.test_structured_bounds import backend  # noqa: F401 - a fixture

END = 9  # a reasoning model's end-of-thinking token


class PickyMatcher(RecordingMatcher):
    """Accepts every token but 13; the output is complete after token 12."""

    def accept(self, token_id):
        self.tokens.append(token_id)
        return token_id != 13

    def valid_prefix(self, tokens):
        return next((i for i, t in enumerate(tokens) if t == 13), len(tokens))

    @property
    def is_terminated(self):
        return bool(self.tokens) and self.tokens[-1] == 12


def _req(rid: str, grammar, after: int | None = None) -> Request:
    spec = StructuredOutput("json_object", after_token=after)
    req = Request(rid, [1, 2, 3], SamplingParams(structured=spec, temperature=0),
                  max_tokens=16)
    req.grammar = grammar
    return req


def test_guesses_are_cut_at_the_first_the_grammar_rejects():
    req = _req("r", PickyMatcher(AllowBackend(16)))
    assert guesses_allowed(req, [4, 5, 13, 6]) == [4, 5]
    assert guesses_allowed(req, [13, 4]) == []
    assert guesses_allowed(req, [4, 5]) == [4, 5]
    assert guesses_allowed(_req("free", None), [13, 4]) == [13, 4]


def test_a_waiting_grammar_takes_guesses_up_to_its_start_token():
    req = _req("r", PickyMatcher(AllowBackend(16)), after=END)
    assert guesses_allowed(req, [13, 4]) == [13, 4]  # thinking: anything goes
    assert guesses_allowed(req, [13, END, 4, 5]) == [13, END]


def test_each_row_is_masked_by_the_grammar_after_the_guesses_before_it():
    own = RecordingMatcher(AllowBackend(16, [4]))
    req, free = _req("r", own), _req("free", None)
    every = [free, req, req, req]
    masks = fill_grammar_masks(every, [[], [], [5], [5, 6]])
    assert masks is not None and masks.rows == [1, 2, 3]
    assert own.tokens == []  # the request's matcher did not move

    waiting = _req("w", RecordingMatcher(AllowBackend(16, [4])), after=END)
    masks = fill_grammar_masks([waiting] * 3, [[], [7], [7, END]])
    assert masks is not None and masks.rows == [2]  # only the row after the start token


def test_the_run_a_request_keeps_advances_its_grammar_and_ends_where_it_completes():
    req = _req("r", PickyMatcher(AllowBackend(16)))
    sampled = {"r": [4, 12, 5, 6]}
    advance_grammars([req], sampled, {})
    assert sampled["r"] == [4, 12] and req.grammar.tokens == [4, 12]

    waiting = _req("w", PickyMatcher(AllowBackend(16)), after=END)
    sampled = {"w": [7, END, 4, 5]}
    advance_grammars([waiting], sampled, {})
    assert waiting.grammar_after is None and waiting.grammar.tokens == [4, 5]

    bad = _req("b", PickyMatcher(AllowBackend(16)))
    failed: dict[str, str] = {}
    advance_grammars([bad], {"b": [4, 13, 5]}, failed)
    assert "token 13 rejected" in failed["b"]


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    keep = keep_bits(bitmask_row[None], vocab)[0]
    return set(keep.nonzero().squeeze(1).tolist())


def test_llguidance_matchers_check_and_fork_over_guesses(backend):  # noqa: F811
    llg, tokenizer = backend
    grammar = llg.compile("regex", "(yes|no), (red|blue)")
    matcher = grammar.matcher()
    good = tokenizer.encode("yes, red", add_special_tokens=False)
    bad = tokenizer.encode("yes, green", add_special_tokens=False)
    assert matcher.valid_prefix(good) == len(good)
    assert matcher.valid_prefix(bad) < len(bad)
    fork = matcher.fork(good)
    assert fork.is_terminated and not matcher.is_terminated  # the original did not move
    with pytest.raises(ValueError, match="rejects"):
        matcher.fork(bad)

    req = _req("r", matcher)
    masks = fill_grammar_masks([req, req], [[], good[:1]])
    assert masks is not None and masks.rows == [0, 1]
    first, second = (_allowed(masks.bitmask[i], llg.vocab_size) for i in range(2))
    assert good[0] in first and good[0] not in second
    assert good[1] in second
