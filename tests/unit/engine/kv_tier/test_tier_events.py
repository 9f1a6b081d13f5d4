"""What a pod with the tier publishes for prefix-aware routing: a block the pool evicts into
the tier stays published (the pod still serves it), its eviction is published once the tier
lets it go (unless the pool holds it again), and the snapshot lists the tier's hashes."""

from __future__ import annotations

import torch

from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import DiskKVPool, HostKVPool, TierConnector
from tests.unit.engine.kv_tier.test_tier_copies import BS, SHAPE, make_request


def fill(kv: KVCacheManager, rid: str, first_token: int, blocks: int) -> list[int]:
    """A request of `blocks` full blocks, cached and freed; returns their hashes."""
    req = make_request(rid, list(range(first_token, first_token + blocks * BS)))
    kv.allocate_slots(req, blocks * BS)
    kv.free(req)
    return list(req.block_hashes)


def drain(kv: KVCacheManager) -> list[tuple[bool, int | None]]:
    events = kv.pool.events
    assert events is not None
    out = list(events)
    events.clear()
    return out


def test_evicted_into_the_tier_stays_published_until_the_tier_drops_it():
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    kv.pool.record_events()
    TierConnector(kv, HostKVPool(cache, 4))
    a = fill(kv, "a", 0, 4)
    assert drain(kv) == [(True, h) for h in a]
    b = fill(kv, "b", 100, 5)  # evicts a's four into the tier: no eviction published
    assert drain(kv) == [(True, h) for h in b]
    assert sorted(kv.pool.cached_hashes()) == sorted(a + b)  # the snapshot: both
    c = fill(kv, "c", 200, 2)  # evicts b's last two into the full tier: a's LRU two go
    assert drain(kv) == [(False, a[3]), (False, a[2])] + [(True, h) for h in c]
    assert set(kv.pool.cached_hashes()) == set(a[:2]) | set(b) | set(c)

def test_a_disk_tier_keeps_what_the_host_tier_spills_published(tmp_path):
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    kv.pool.record_events()
    block_bytes = cache[:, :, 0].numel() * 4
    host = HostKVPool(cache, 2, disk=DiskKVPool(tmp_path, "fp", block_bytes, 3))
    tier = TierConnector(kv, host)
    a = fill(kv, "a", 0, 4)
    b = fill(kv, "b", 100, 5)  # a's four: the last two in the host tier, two spilled to disk
    assert drain(kv) == [(True, h) for h in a + b]  # no eviction: the tiers keep a's
    assert set(kv.pool.cached_hashes()) == set(a) | set(b)  # spills queued or written
    c = fill(kv, "c", 200, 2)  # two more spills: the disk (3 files) drops its oldest, a[3]
    assert host.io is not None and host.io.wait_idle(10)
    tier.poll()  # the engine thread hears of the worker's drops at a step's start
    assert drain(kv) == [(True, h) for h in c] + [(False, a[3])]
    assert set(kv.pool.cached_hashes()) == set(a[:3]) | set(b) | set(c)
    tier.close()
    assert not host.io.running
