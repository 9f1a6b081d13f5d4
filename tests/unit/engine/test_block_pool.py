"""Block pool and KV manager: ref counts, prefix hashing, LRU eviction, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.common.hashing import hash_token_blocks
from baton.common.sampling_params import SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_cache.block_pool import BlockPool
from baton.engine.request import Request


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=16)


def test_chained_hashes_depend_on_the_whole_prefix():
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_token_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different parent
    assert hash_token_blocks([1, 2, 3, 4, 5], 4) == a[:1]  # partial blocks are not hashed


def test_lru_evicts_least_recently_freed_cached_block():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    (taken,) = pool.allocate(1)
    assert taken is blocks[1] and pool.get_cached_block(101) is None
    assert pool.get_cached_block(100) is blocks[0]


def test_double_free_is_an_error():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="ref_cnt"):
        pool.free([b])


def test_shared_prefix_is_reference_counted():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    b = make_request("b", list(range(12)) + [99])
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and len(hits) == 3
    b.num_computed_tokens = 0
    kv.allocate_slots(b, 1, hits)
    assert [blk.ref_cnt for blk in hits] == [2, 2, 2]
    kv.free(a)
    kv.check_integrity()
    assert kv.num_used_blocks == 4
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.pool.counts() == (7, 3, 0)  # b's tail is partial


def test_full_hit_still_computes_the_last_token():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    hits, n = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert n == 4 and len(hits) == 1


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(20)))
    assert kv.allocate_slots(a, 20) is None
    assert kv.num_used_blocks == 0 and kv.get_block_ids("a") == []


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30), st.booleans()),
                    min_size=1, max_size=40),
       caching=st.booleans())
def test_random_allocations_keep_integrity(ops, caching):
    kv = KVCacheManager(16, 4, caching)
    live: dict[str, Request] = {}
    for rid_n, length, free in ops:
        rid = f"r{rid_n}"
        if free and rid in live:
            kv.free(live.pop(rid))
        elif rid not in live:
            req = make_request(rid, [t % 5 for t in range(length)])
            hits, n = kv.get_computed_blocks(req)
            req.num_computed_tokens = 0
            if kv.allocate_slots(req, length - n, hits) is not None:
                req.num_computed_tokens = length
                live[rid] = req
        kv.check_integrity()
    for req in live.values():
        kv.free(req)
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_a_block_table_row_follows_its_requests_blocks():
    """`get_block_ids` reads a row kept between steps: it changes when the request gains a
    block, and each caller gets a list of its own."""
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(6)))
    assert kv.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    first = kv.get_block_ids("a")
    first.append(99)  # the caller's copy
    assert kv.get_block_ids("a") == first[:2] == kv.block_row("a").tolist()
    assert kv.block_row("a") is kv.block_row("a")  # the batch builder's: no copy
    with pytest.raises(ValueError, match="read-only"):
        kv.block_row("a")[0] = 5  # nobody changes the kept row
    assert kv.allocate_slots(a, 2) == []  # tokens 6, 7: its last block has room
    a.num_computed_tokens = 8
    assert kv.get_block_ids("a") == first[:2]
    assert len(kv.allocate_slots(a, 1)) == 1  # token 8: a third block
    row = kv.get_block_ids("a")
    assert row[:2] == first[:2] and len(row) == 3
    kv.check_integrity()
    kv.free(a)
    assert kv.get_block_ids("a") == []
    kv.check_integrity()


def test_a_window_release_shows_in_the_row_even_when_the_allocation_fails():
    """A sliding window releases a request's leading blocks before the pool is asked for new
    ones; with no room the allocation fails, and the row already shows the release."""
    kv = KVCacheManager(6, 4, sliding_window=4)
    a = make_request("a", list(range(20)))
    assert kv.allocate_slots(a, 8) is not None  # blocks 0, 1
    a.num_computed_tokens = 8
    b = make_request("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 16) is not None  # the other four
    before = kv.get_block_ids("a")
    # from position 8 a window of 4 sees 5..: block 0 is released, then 3 more are needed
    assert kv.allocate_slots(a, 12) is None
    assert kv.get_block_ids("a") == [before[1], before[1]]
    kv.check_integrity()
