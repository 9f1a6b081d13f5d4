"""Prompt lookup and greedy acceptance (`engine.spec`), on plain token lists."""

from __future__ import annotations

import numpy as np
import pytest

from baton.engine.spec.config import SpeculativeConfig
from baton.engine.spec.ngram import TokenHistory, lookup
from baton.engine.spec.verify import accepted_run


def _lookup(tokens: list[int], k: int = 4, n_min: int = 2, n_max: int = 4) -> list[int]:
    return lookup(np.asarray(tokens, dtype=np.int64), k, n_min, n_max)


def test_the_longest_suffix_match_wins_and_the_latest_place_of_it():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]  # suffix (6, 7): at 1 and 6
    assert _lookup(seq) == [3, 4, 6, 7]  # the latest: after position 7
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 5, 6, 7]  # suffix (5, 6, 7): only at 0
    assert _lookup(seq) == [8, 9, 1, 6]


def test_nothing_to_guess():
    assert _lookup([1, 2, 3, 4]) == []
    assert _lookup([1]) == []
    assert _lookup([7, 7], n_min=2) == []  # the suffix itself is not an earlier place
    assert _lookup([1, 2, 9, 1, 2], k=1) == [9]


def test_a_history_grows_without_losing_tokens():
    history = TokenHistory([1, 2, 3])
    for i in range(200):
        history.extend([i, i + 1])
    assert history.len == 403
    assert history.tokens[:5].tolist() == [1, 2, 3, 0, 1]
    assert history.tokens[-2:].tolist() == [199, 200]


@pytest.mark.parametrize("guesses,targets,kept", [
    ([], [4], 0), ([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 5, 3, 4], 1),
    ([1, 2], [9, 2, 3], 0)])
def test_greedy_acceptance_keeps_the_run_the_target_agrees_with(guesses, targets, kept):
    assert accepted_run(guesses, targets) == kept


def test_the_config_names_what_is_wrong():
    assert not SpeculativeConfig.parse(None).enabled
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 6}')
    assert cfg.enabled and cfg.num_speculative_tokens == 6
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg
    for bad, match in [('{"method": "eagle"}', "not built"), ("[1]", "JSON object"),
                       ('{"method": "ngram", "k": 3}', "no field 'k'"), ("{", "not JSON"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', r"\[1, 16\]")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
