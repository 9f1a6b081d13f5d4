"""The cross-request suffix index (`engine.spec.suffix`): it finds what followed the longest
matching n-gram in the latest output holding it, never reads across outputs, forgets what
the ring overwrote, and stays bounded."""

from __future__ import annotations

import random

import pytest

from baton.engine.spec.suffix import SuffixIndex


def test_the_longest_match_in_the_latest_output_wins():
    ix = SuffixIndex(capacity=64, n_min=2, n_max=4)
    ix.add([1, 2, 3, 4, 5, 6])
    assert ix.lookup([9, 2, 3], 3) == [4, 5, 6]
    assert ix.lookup([3, 4], 5) == [5, 6]  # stops at the end of its output
    assert ix.lookup([7, 8], 2) == [] and ix.lookup([4], 2) == []  # below n_min
    ix.add([2, 3, 9, 9])
    assert ix.lookup([2, 3], 3) == [9, 9]  # the latest
    assert ix.lookup([1, 2, 3], 3) == [4, 5, 6]  # the longest


def test_overwritten_tokens_are_forgotten_and_the_index_stays_bounded():
    ix = SuffixIndex(capacity=64, n_min=2, n_max=4)
    ix.add([100, 101, 102, 103])
    rng = random.Random(0)
    for _ in range(300):
        ix.add([rng.randrange(6) for _ in range(rng.randrange(1, 20))])
        assert len(ix._ends) <= 3 * 64  # one entry per size per position at most
    assert ix.lookup([100, 101], 2) == []  # long gone
    assert len(ix) == 64


def test_refuses_a_useless_size():
    with pytest.raises(ValueError, match="capacity"):
        SuffixIndex(capacity=8)
