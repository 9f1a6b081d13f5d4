"""Routing plugins on their own: filters, scorers, pickers and the pipeline."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from baton.router.discovery import BreakerSettings, StaticDiscovery, Upstream
from baton.router.scheduling.context import Phase, RoutingContext
from baton.router.scheduling.filters import FILTERS
from baton.router.scheduling.pickers import PICKERS
from baton.router.scheduling.pipeline import RoutingPipeline
from baton.router.scheduling.scorers import SCORERS


def ep(name: str, **kw) -> Upstream:
    kw.setdefault("healthy", True)
    kw.setdefault("model", "m")
    return Upstream(f"http://{name}", **kw)


def test_filters():
    a, b, c, d = ep("a"), ep("b", healthy=False), ep("c", model="other"), ep("d", role="prefill")
    ctx = RoutingContext(model="m", phase=Phase.DECODE, tried=frozenset({"http://a"}))
    assert FILTERS["healthy"]([a, b], ctx) == [a]
    assert FILTERS["model"]([a, c], ctx) == [a]
    assert FILTERS["model"]([a, c], RoutingContext(model=None)) == [a, c]
    assert FILTERS["role"]([a, d], ctx) == [a]
    assert FILTERS["role"]([a, d], RoutingContext(phase=Phase.PREFILL)) == [d]
    decode = ep("e", role="decode")
    assert FILTERS["role"]([a, d, decode], RoutingContext(phase=Phase.RESUME)) == [decode]
    assert FILTERS["role"]([a, d, decode], ctx) == [a, decode]
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
    ctx = RoutingContext(model="m").after_failure(idle)
    assert ctx.tried == {"http://idle"} and p.pick([busy, idle], ctx) is busy


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
    from baton.router.prefix import CHARS_PER_BLOCK, ApproximatePrefixIndex, block_hashes

    text = "".join(chr(65 + i % 26) for i in range(CHARS_PER_BLOCK * 5 + 10))
    hashes = block_hashes(text)
    assert len(hashes) == 5  # whole blocks only
    assert block_hashes(text[:CHARS_PER_BLOCK * 2]) == hashes[:2]  # a hash names a prefix
    other = block_hashes("x" + text[1:])
    assert not set(other) & set(hashes)  # a different first block changes every hash
    assert len(block_hashes(list(range(40)))) == 2  # token prompts: 16 ids a block
    assert all(isinstance(h, str) and int(h, 16) >= 0 for h in hashes)  # hex, as the registry's
    index = ApproximatePrefixIndex(capacity_per_worker=6)
    a, b = ep("a"), ep("b")
    index.add(a, hashes[:3])
    assert index.match(a, hashes) == 3 and index.match(b, hashes) == 0
    ctx = RoutingContext(model="m", prefix_hashes=hashes, prefix_index=index)
    assert SCORERS["prefix"]([a, b], ctx) == [0.6, 0.0]
    assert RoutingPipeline.from_policy("load").pick([b, a], ctx) is a  # equal load: affinity
    index.add(a, other)  # 5 more: the LRU keeps the newest 6
    assert index.match(a, hashes) == 0 and index.match(a, other) == 5
    index.forget(a)
    assert index.match(a, other) == 0


def test_exact_block_index_takes_the_same_keys_and_hashes():
    from baton.common.hashing import hash_token_blocks
    from baton.common.registry import hash_hex
    from baton.router.prefix import BlockIndex

    hashes = [hash_hex(h) for h in hash_token_blocks(list(range(12)), 4)]  # 3 blocks
    index = BlockIndex()
    assert index.apply({"id": "w1", "seq": 1, "reset": True, "added": hashes[:2],
                        "removed": []})
    a, restarted, static = ep("a", worker_id="w1"), ep("a", worker_id="w2"), ep("b")
    assert index.match(a, hashes) == 2 and index.blocks_held(a) == 2
    assert index.match(restarted, hashes) == 0 and index.match(static, hashes) == 0
    assert not index.apply({"id": "w1", "seq": 3, "added": hashes, "removed": []})  # a gap
    index.add(a, hashes)  # the workers themselves say what they hold
    index.forget(a)
    assert index.match(a, hashes) == 2
    ctx = RoutingContext(model="m", prefix_hashes=hashes, prefix_index=index, block_tokens=4)
    assert SCORERS["prefix"]([a, static], ctx) == [pytest.approx(2 / 3), 0.0]
    assert ctx.cached_tokens(a) == 8 and ctx.cached_tokens(static) == 0


def test_disagg_decider_counts_the_prompt_not_cached_on_the_decode_pod():
    from dataclasses import replace

    from baton.router.prefix import ApproximatePrefixIndex, block_hashes
    from baton.router.scheduling.disagg import DECIDERS, DisaggSettings

    hashes = block_hashes(list(range(64)))  # 4 blocks of 16 token ids
    index = ApproximatePrefixIndex()
    pod, other = ep("d", role="decode"), ep("e", role="decode")
    index.add(pod, hashes[:2])
    ctx = RoutingContext(model="m", prefix_hashes=hashes, prefix_index=index,
                         prompt_tokens=64)
    s = DisaggSettings(min_prefill_tokens=40)
    assert s.decide(other, ctx) and s.decide(None, ctx)  # 64 tokens to prefill
    assert not s.decide(pod, ctx)  # 32 cached there: 32 < 40
    assert DisaggSettings(min_prefill_tokens=32).decide(pod, ctx)
    assert not s.decide(other, replace(ctx, prompt_tokens=None))  # cannot be split
    assert DECIDERS[s.decider] is DECIDERS["uncached_tokens"]
    with pytest.raises(ValueError, match="unknown disaggregation decider 'coin'; known: "
                                         r"\['uncached_tokens'\]"):
        DisaggSettings(decider="coin")
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        DisaggSettings(min_prefill_tokens=-1)
