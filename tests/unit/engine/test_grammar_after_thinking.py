"""A grammar that starts after a reasoning model's thinking (`StructuredOutput.after_token`):
no mask and no matcher step until the end-of-thinking token is sampled, the grammar from
the next token on; a resumed or pulled request rebuilt over earlier tokens the same way;
and a grammar that has not started is never complete."""

from __future__ import annotations

import torch

from baton import SamplingParams
from baton.common.sampling_params import StructuredOutput
from baton.engine.request import Request
from baton.engine.sampler import Sampler
from baton.engine.structured.manager import grammar_complete, rebuild
from baton.engine.structured.masks import advance_grammars, fill_grammar_masks
from tests.unit.engine.test_structured import AllowBackend, RecordingMatcher

END = 9  # the end-of-thinking token


class DoneMatcher(RecordingMatcher):
    @property
    def is_terminated(self):
        return True


def thinking_req(rid: str, grammar, after: int | None = END, **params) -> Request:
    spec = StructuredOutput("json_object", after_token=after)
    req = Request(rid, [1, 2, 3], SamplingParams(structured=spec, **params), max_tokens=16)
    req.grammar = grammar
    return req


def test_the_grammar_waits_for_the_end_of_thinking_then_constrains():
    backend = AllowBackend(16, [4])
    matcher = RecordingMatcher(backend)
    req = thinking_req("r", matcher, temperature=0)
    sampler = Sampler()

    def step(best: int) -> int:
        logits = torch.zeros(1, 16)
        logits[0, best] = 5.0
        tokens, _ = sampler(logits, [req], {}, fill_grammar_masks([req]))
        advance_grammars([req], {"r": tokens}, {})
        return tokens[0]

    assert fill_grammar_masks([req]) is None and req.active_grammar is None
    assert step(7) == 7 and step(4) == 4  # thinking: the model's own choice, unmasked
    assert matcher.tokens == [] and req.grammar_after == END
    assert step(END) == END  # the end of thinking is free too, and opens the grammar
    assert req.grammar_after is None and req.active_grammar is matcher
    assert matcher.tokens == []  # the grammar starts after it
    assert step(7) == 4  # now masked: only 4 is allowed
    assert matcher.tokens == [4]


def test_a_request_without_after_token_is_constrained_from_its_first_token():
    matcher = RecordingMatcher(AllowBackend(16, [4]))
    req = thinking_req("r", matcher, after=None, temperature=0)
    assert fill_grammar_masks([req]).rows == [0]


def test_rebuild_skips_the_thinking_of_earlier_tokens():
    matcher = RecordingMatcher(AllowBackend(16, range(16)))
    req = thinking_req("r", matcher)
    req.prompt_token_ids = [1, 2, 3, 7, END, 5]  # a resumed stream sent 7, END, 5
    req.num_presampled = 3
    assert rebuild(req) is None
    assert matcher.tokens == [5] and req.grammar_after is None
    still = RecordingMatcher(AllowBackend(16, range(16)))
    req = thinking_req("s", still)
    req.prompt_token_ids = [1, 2, 3, 7, 8]
    req.num_presampled = 2
    assert rebuild(req) is None and still.tokens == [] and req.grammar_after == END


def test_a_grammar_not_started_is_not_complete():
    req = thinking_req("r", DoneMatcher(AllowBackend(16, [4])))
    assert not grammar_complete(req)
    req.see_grammar_start(3)
    assert not grammar_complete(req)
    req.see_grammar_start(END)
    assert grammar_complete(req)
