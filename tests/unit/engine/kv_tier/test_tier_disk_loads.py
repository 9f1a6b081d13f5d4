"""Loads from the disk tier run off the engine thread: a restarted tier's prefix hit issues
its reads on the worker and `poll()` reports the request loaded only once they landed; a
damaged block sends the request back to compute those tokens (the P/D pull's recompute
fallback) with the KV a forward reads still right; a request that ends mid-read frees its
blocks at once; and a step copies at most `max_loads_per_step` blocks, the rest waiting for
the next step; an engine with only such loads in flight polls instead of spinning."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import DiskKVPool, HostKVPool, TierConnector
from baton.engine.scheduler import SchedulerLimits, make_scheduler
from baton.engine.scheduler.scheduler import LOAD_POLL_S
from tests.unit.engine.kv_tier.test_disk_worker import GatedDisk
from tests.unit.engine.kv_tier.test_tier_copies import (
    BS,
    SHAPE,
    make_request,
    run_prefix_evicted_then_hit,
)
from tests.unit.engine.kv_tier.test_tier_properties import fake_forward
from tests.unit.engine.kv_tier.test_tier_properties import make_request as make_turn

BLOCK_BYTES = SHAPE[0] * SHAPE[1] * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4


def written_then_restarted(root: Path, disk_cls=DiskKVPool):
    """A tier writes four blocks of KV 1..4 (a request's prompt) to disk at its stop; a new
    one over the same directory (a restart) gets the request again plus a token and starts
    loading all four from disk. Returns its cache, pool, tier, request and disk pool."""
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    first = TierConnector(kv, HostKVPool(cache, 8, disk=DiskKVPool(root, "fp", BLOCK_BYTES, 16)))
    a = make_request("a", list(range(4 * BS)))
    kv.allocate_slots(a, 4 * BS)
    for i, block_id in enumerate(kv.get_block_ids("a")):
        cache[:, :, block_id] = i + 1.0
    kv.free(a)
    first.close()  # a graceful stop writes the device pool's blocks
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    disk = disk_cls(root, "fp", BLOCK_BYTES, 16)
    tier = TierConnector(kv, HostKVPool(cache, 8, disk=disk))
    again = make_request("a2", list(range(4 * BS)) + [7])
    computed, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 0 and tier.num_remote_tokens(again, 0) == 4 * BS
    assert kv.allocate_slots(again, 4 * BS, computed, publish=False) is not None
    tier.start_load(again, kv.get_block_ids("a2"), 0)
    return cache, kv, tier, again, disk


def test_a_load_from_disk_ends_through_poll_once_its_reads_landed(tmp_path):
    cache, kv, tier, again, disk = written_then_restarted(tmp_path, GatedDisk)
    for _ in range(3):  # the reads wait at the gate: the engine thread does not
        assert tier.poll().loaded == [] and tier.num_loading == 1 and tier.has_pending
    assert tier.tier_stats().disk_queue_depth == 4
    disk.gate.set()
    assert tier.host.io is not None and tier.host.io.wait_idle(10)
    assert tier.poll().loaded == [again] and not tier.has_pending
    for i, block_id in enumerate(kv.get_block_ids("a2")):
        assert torch.equal(cache[:, :, block_id], torch.full_like(cache[:, :, 0], i + 1.0))
    stats = tier.tier_stats()
    assert stats.disk_read_blocks_total == 4 and stats.hit_blocks_total == 4
    assert stats.disk_read_failures_total == 0 and stats.disk_queue_depth == 0
    kv.free(again)
    kv.check_integrity()
    tier.close()


def test_a_damaged_disk_block_falls_back_to_computing_it(tmp_path):
    _, kv, tier, again, _ = written_then_restarted(tmp_path, GatedDisk)
    path = tmp_path / "fp" / f"{again.block_hashes[2]:016x}.kv"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")  # block 2's last byte
    assert tier.host.io is not None
    tier.host.io.disk.gate.set()
    assert tier.host.io.wait_idle(10)
    updates = tier.poll()
    assert updates.loaded == [] and updates.recompute == [again] and tier.num_loading == 0
    stats = tier.tier_stats()
    assert stats.disk_read_failures_total == 1 and stats.load_fallbacks_total == 1
    assert not path.exists()
    kv.free(again)  # what the scheduler does with a request to recompute
    # Admitted again: blocks 0 and 1 landed in the host tier; 2 is gone, so it computes on
    assert tier.num_remote_tokens(again, 0) == 2 * BS
    kv.check_integrity()
    tier.close()


def test_a_request_ended_mid_read_frees_its_blocks_at_once(tmp_path):
    _, kv, tier, again, disk = written_then_restarted(tmp_path, GatedDisk)
    assert tier.request_finished(again, kv.get_block_ids("a2")) == (False, None)
    kv.free(again)  # the reads fill host blocks only: the device blocks are free now
    disk.gate.set()
    assert tier.host.io is not None and tier.host.io.wait_idle(10)
    updates = tier.poll()
    assert updates.loaded == updates.recompute == [] and tier.num_loading == 0
    assert len(tier.host) == 4 and not tier.loads.pinned  # the reads joined the host tier
    kv.check_integrity()
    tier.close()


def test_a_step_copies_at_most_its_bound_and_the_rest_waits():
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    tier = TierConnector(kv, HostKVPool(cache, 16), max_loads_per_step=3)

    def write(ids, value):
        for block_id in ids:
            cache[:, :, block_id] = value

    again, _ = run_prefix_evicted_then_hit(cache, kv, tier, write)
    assert tier.poll().loaded == [] and tier.num_loading == 1  # three of four copied
    assert tier.tier_stats().load_queue_blocks == 1
    assert tier.poll().loaded == [again]  # the next step copies the fourth
    for i, block_id in enumerate(kv.get_block_ids("a2")):
        assert torch.equal(cache[:, :, block_id], torch.full_like(cache[:, :, 0], i + 1.0))
    assert tier.tier_stats().load_queue_blocks == 0


def scheduled_engine(root: Path, disk_cls=DiskKVPool):
    """A scheduler over a 16-block pool of 4-token blocks, a host tier and a disk tier in
    `root`: its cache (a token's KV is its id: `fake_forward`), pool, tier, scheduler, disk."""
    cache = torch.full((1, 2, 16, 4, 1, 1), -1.0, dtype=torch.float64)
    kv = KVCacheManager(16, 4)
    disk = disk_cls(root, "fp", cache[:, :, 0].numel() * 8, 64)
    tier = TierConnector(kv, HostKVPool(cache, 32, disk=disk))
    return cache, kv, tier, make_scheduler(SchedulerLimits(64, 4, 512), kv, tier), disk


def run_turn(turn, cache, sched) -> None:
    sched.add_request(turn)
    deadline = time.monotonic() + 30  # steps spin while the reads are on the worker
    while sched.has_unfinished_requests():
        assert time.monotonic() < deadline, f"{turn.request_id} never finished"
        fake_forward(sched, cache, 4)


def test_the_scheduler_computes_what_a_damaged_block_held(tmp_path):
    """Through the scheduler, a fake forward checking every token's KV: a conversation's
    turn, a restart, one of its blocks damaged on disk; the next turn loads the blocks before
    it, computes the rest, and every block comes back to the pool."""
    cache, kv, tier, sched, _ = scheduled_engine(tmp_path)
    first = make_turn(0, 0, 30, 2)
    run_turn(first, cache, sched)
    tier.close()  # a graceful stop: the turn's 7 full blocks go to disk
    path = tmp_path / "fp" / f"{first.block_hashes[3]:016x}.kv"
    path.write_bytes(b"BATONKV1" + path.read_bytes()[8:][::-1])  # block 3 garbled
    cache, kv, tier, sched, _ = scheduled_engine(tmp_path)
    second = make_turn(1, 0, 40, 2)
    run_turn(second, cache, sched)
    assert second.num_cached_tokens == 3 * 4  # blocks 0-2, loaded again
    stats = tier.tier_stats()
    assert stats.load_fallbacks_total == 1 and stats.disk_read_failures_total == 1
    assert kv.num_used_blocks == 0 and tier.num_loading == 0
    kv.check_integrity()
    tier.close()


def test_an_engine_with_only_loads_in_flight_polls_instead_of_spinning(tmp_path):
    cache, _, tier, sched, _ = scheduled_engine(tmp_path)
    run_turn(make_turn(0, 0, 30, 2), cache, sched)
    tier.close()
    cache, kv, tier, sched, disk = scheduled_engine(tmp_path, GatedDisk)
    sched.add_request(make_turn(1, 0, 40, 2))
    assert sched.idle_for() == 0  # a request waits to be admitted
    fake_forward(sched, cache, 4)  # admitted: its blocks are read from disk (held back)
    assert sched.num_running == 0 and tier.num_loading == 1
    assert sched.idle_for() == LOAD_POLL_S  # nothing to run: the engine may sleep
    disk.gate.set()
    assert tier.host.io is not None and tier.host.io.wait_idle(10)
    fake_forward(sched, cache, 4)  # loaded: it runs
    assert sched.num_running == 1 and sched.idle_for() == 0
    while sched.has_unfinished_requests():
        fake_forward(sched, cache, 4)
    kv.check_integrity()
    tier.close()


def test_requests_waiting_behind_loads_in_flight_do_not_make_the_engine_spin(tmp_path):
    """Nothing runs, one load is in flight and a request waits for the blocks it holds:
    schedule() can do nothing until the load ends, so the engine polls, not spins."""
    cache, _, tier, sched, _ = scheduled_engine(tmp_path)
    run_turn(make_turn(0, 0, 30, 2), cache, sched)
    tier.close()
    cache, kv, tier, sched, disk = scheduled_engine(tmp_path, GatedDisk)
    sched.add_request(make_turn(1, 0, 40, 2))
    fake_forward(sched, cache, 4)  # its blocks are read from disk (held back)
    sched.add_request(make_turn(2, 5, 40, 2))  # 10 blocks: more than the 9 left
    fake_forward(sched, cache, 4)
    assert sched.num_running == 0 and sched.num_waiting == 1 and tier.num_loading == 1
    assert sched.idle_for() == LOAD_POLL_S
    disk.gate.set()
    assert tier.host.io is not None and tier.host.io.wait_idle(10)
    while sched.has_unfinished_requests():
        fake_forward(sched, cache, 4)
    kv.check_integrity()
    tier.close()
