"""What a pod with the tiers publishes for prefix-aware routing: each tier's blocks apart —
a block the pool evicts leaves the device set and joins the host tier's, one the host tier
evicts leaves it (and joins the disk tier's once its spill is queued), one the disk tier
lets go leaves that; a block read back from disk joins the host tier's again. The snapshot
lists every (hash, tier)."""

from __future__ import annotations

import torch

from baton.common.registry import DEVICE, DISK, HOST
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import DiskKVPool, HostKVPool, TierConnector
from tests.unit.engine.kv_tier.test_tier_copies import BS, SHAPE, make_request


def fill(kv: KVCacheManager, rid: str, first_token: int, blocks: int) -> list[int]:
    """A request of `blocks` full blocks, cached and freed; returns their hashes."""
    req = make_request(rid, list(range(first_token, first_token + blocks * BS)))
    kv.allocate_slots(req, blocks * BS)
    kv.free(req)
    return list(req.block_hashes)


def drain(kv: KVCacheManager) -> list[tuple[bool, int | None, str]]:
    events = kv.pool.events
    assert events is not None
    out = list(events)
    events.clear()
    return out


def stored(hashes, tier=DEVICE) -> list[tuple[bool, int, str]]:
    return [(True, h, tier) for h in hashes]


def test_each_tier_publishes_its_own_blocks():
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    kv.pool.record_events()
    TierConnector(kv, HostKVPool(cache, 4))
    a = fill(kv, "a", 0, 4)
    assert drain(kv) == stored(a)
    b = fill(kv, "b", 100, 5)  # evicts a's four from the pool into the host tier
    evicted = [(False, h, DEVICE) for h in reversed(a)]  # the tail first
    moved = [e for h in reversed(a) for e in ((False, h, DEVICE), (True, h, HOST))]
    events = drain(kv)
    assert [e for e in events if e[2] == DEVICE and not e[0]] == evicted
    assert events == moved + stored(b)
    assert sorted(kv.pool.held_hashes()) == sorted([(h, DEVICE) for h in b]
                                                   + [(h, HOST) for h in a])
    c = fill(kv, "c", 200, 2)  # evicts b's last two into the full host tier: a's LRU two go
    assert drain(kv) == [(False, b[4], DEVICE), (False, a[3], HOST), (True, b[4], HOST),
                         (False, b[3], DEVICE), (False, a[2], HOST), (True, b[3], HOST),
                         *stored(c)]
    assert set(kv.pool.held_hashes()) == ({(h, DEVICE) for h in b[:3] + c}
                                          | {(h, HOST) for h in a[:2] + b[3:]})


def test_a_disk_tier_publishes_the_host_tiers_spills(tmp_path):
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    kv.pool.record_events()
    block_bytes = cache[:, :, 0].numel() * 4
    host = HostKVPool(cache, 2, disk=DiskKVPool(tmp_path, "fp", block_bytes, 3))
    tier = TierConnector(kv, host)
    a = fill(kv, "a", 0, 4)
    b = fill(kv, "b", 100, 5)  # a's four: the last two in the host tier, two spilled to disk
    events = drain(kv)
    assert [e for e in events if e[0] and e[2] == DEVICE] == stored(a + b)
    assert {e for e in events if e[2] == DISK} == set(stored(a[2:], DISK))  # a[3], a[2]
    assert {(h, t) for h, t in kv.pool.held_hashes() if t != DEVICE} == (
        {(h, HOST) for h in a[:2]} | {(h, DISK) for h in a[2:]})  # spills queued or written
    fill(kv, "c", 200, 2)  # two more spills: the disk (3 files) drops its oldest, a[3]
    assert host.io is not None and host.io.wait_idle(10)
    drain(kv)
    tier.poll()  # the engine thread hears of the worker's drops at a step's start
    assert drain(kv) == [(False, a[3], DISK)]
    assert {h for h, t in kv.pool.held_hashes() if t == DISK} == set(a[:3])
    tier.close()
    assert host.io.stopped
