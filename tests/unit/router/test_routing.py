"""Routing plugins on their own: filters, scorers, pickers and the pipeline."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from baton.router.discovery import BreakerSettings, Endpoint, StaticDiscovery
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.filters import FILTERS
from baton.router.scheduling.pickers import PICKERS
from baton.router.scheduling.pipeline import RoutingPipeline
from baton.router.scheduling.scorers import SCORERS


def ep(name: str, **kw) -> Endpoint:
    kw.setdefault("healthy", True)
    kw.setdefault("model", "m")
    return Endpoint(f"http://{name}", **kw)


def test_filters():
    a, b, c, d = ep("a"), ep("b", healthy=False), ep("c", model="other"), ep("d", role="prefill")
    ctx = RoutingContext(model="m", role="decode", tried={"http://a"})
    assert FILTERS["healthy"]([a, b], ctx) == [a]
    assert FILTERS["model"]([a, c], ctx) == [a]
    assert FILTERS["model"]([a, c], RoutingContext(model=None)) == [a, c]
    assert FILTERS["role"]([a, d], ctx) == [a]
    assert FILTERS["role"]([a, d], RoutingContext(role="prefill")) == [d]
    full = ep("full", waiting=8, max_waiting=8)
    assert FILTERS["not_saturated"]([a, full], ctx) == [a]
    assert FILTERS["not_tried"]([a, c], ctx) == [c]
    e = ep("e", open_until=time.monotonic() + 60)
    assert FILTERS["circuit"]([a, e], ctx) == [a]


def test_scorers_are_in_unit_interval_and_ordered():
    idle, busy, full = ep("i"), ep("b", running=3, waiting=2), ep("f", kv_blocks_used=10,
                                                                    kv_blocks_total=10)
    q = SCORERS["queue"]([idle, busy], RoutingContext())
    assert q[0] == 1.0 and 0 < q[1] < q[0]
    kv = SCORERS["kv_usage"]([idle, full], RoutingContext())
    assert kv == [1.0, 0.0]
    # The router's own in-flight count covers for a stale report.
    assert SCORERS["queue"]([ep("x", inflight=4)], RoutingContext())[0] == pytest.approx(0.2)


def test_max_score_picker_breaks_ties_round_robin():
    pick = PICKERS["max_score"]()
    a, b, c = ep("a"), ep("b"), ep("c")
    picks = Counter(pick([a, b, c], [1.0, 1.0, 0.5]).url for _ in range(10))
    assert picks == {"http://a": 5, "http://b": 5}


def test_round_robin_and_random_pickers():
    rr = PICKERS["round_robin"]()
    a, b = ep("b"), ep("a")
    assert [rr([a, b], [0, 0]).url for _ in range(4)] == ["http://a", "http://b"] * 2
    rnd = PICKERS["random"](seed=1)
    counts = Counter(rnd([a, b], [3.0, 1.0]).url for _ in range(4000))
    assert 0.7 < counts["http://b"] / 4000 < 0.8


def test_pipeline_load_policy_prefers_the_idle_worker():
    p = RoutingPipeline.from_policy("load")
    busy, idle = ep("busy", running=8, kv_blocks_used=50, kv_blocks_total=100), ep("idle")
    assert p.pick([busy, idle], RoutingContext(model="m")) is idle
    assert p.pick([busy, ep("down", healthy=False)], RoutingContext(model="m")) is busy
    assert p.pick([ep("down", healthy=False)], RoutingContext(model="m")) is None
    # On retry the failed one is out even if it scores best.
    assert p.pick([busy, idle], RoutingContext(model="m", tried={"http://idle"})) is busy


def test_pipeline_rejects_unknown_names_and_negative_weights():
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingPipeline.from_policy("fastest")
    with pytest.raises(ValueError, match="unknown routing scorer"):
        RoutingPipeline(scorers={"vibes": 1.0})
    with pytest.raises(ValueError, match="negative weight"):
        RoutingPipeline(scorers={"queue": -1.0})
    with pytest.raises(ValueError, match="unknown routing filter"):
        RoutingPipeline(filters=("healthy", "nope"))
    with pytest.raises(ValueError, match="unknown routing picker"):
        RoutingPipeline(picker="nope")


def test_circuit_breaker_opens_after_threshold():
    d = StaticDiscovery(["http://a"], breaker=BreakerSettings(threshold=2, cooldown_s=60))
    a = d.all()[0]
    d.record_failure(a)
    assert not a.circuit_open()
    d.record_failure(a)
    assert a.circuit_open()
    d.record_success(a)
    assert not a.circuit_open() and a.consecutive_failures == 0


def test_prefix_index_and_scorer():
    from baton.router.prefix import CHARS_PER_BLOCK, PrefixIndex, block_hashes

    text = "".join(chr(65 + i % 26) for i in range(CHARS_PER_BLOCK * 5 + 10))
    hashes = block_hashes(text)
    assert len(hashes) == 5  # whole blocks only
    assert block_hashes(text[:CHARS_PER_BLOCK * 2]) == hashes[:2]  # a hash names a prefix
    other = block_hashes("x" + text[1:])
    assert not set(other) & set(hashes)  # a different first block changes every hash
    assert len(block_hashes(list(range(40)))) == 2  # token prompts: 16 ids a block
    index = PrefixIndex(capacity_per_worker=6)
    a, b = ep("a"), ep("b")
    index.add(a.url, hashes[:3])
    assert index.match(a.url, hashes) == 3 and index.match(b.url, hashes) == 0
    ctx = RoutingContext(model="m", prefix_hashes=hashes, prefix_index=index)
    assert SCORERS["prefix"]([a, b], ctx) == [0.6, 0.0]
    assert RoutingPipeline.from_policy("load").pick([b, a], ctx) is a  # equal load: affinity
    index.add(a.url, other)  # 5 more: the LRU keeps the newest 6
    assert index.match(a.url, hashes) == 0 and index.match(a.url, other) == 5
    index.forget(a.url)
    assert index.match(a.url, other) == 0
