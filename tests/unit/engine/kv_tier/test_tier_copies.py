"""The tier's copies without a model: an evicted block's KV comes back bit for bit into the
block a later prefix hit allocates, the host pool evicts least recently used first and never
a block a load is about to read, and on the `meta` device (no values: any read-back raises)
the whole copy path runs with stream-ordered `copy_`s only."""

from __future__ import annotations

import torch

from baton.common.sampling_params import SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import HostKVPool, TierConnector
from baton.engine.request import Request
from tests.unit.engine.test_sampler_device import Recorder

BS = 4  # tokens per block
SHAPE = (2, 2, 5, BS, 1, 3)  # (layers, K/V, blocks, block_size, KVH, D): a 5-block pool


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def make_tier(device: str = "cpu", host_blocks: int = 16):
    cache = torch.zeros(SHAPE, device=device)
    kv = KVCacheManager(SHAPE[2], BS)
    return cache, kv, TierConnector(kv, HostKVPool(cache, host_blocks, host_device=device))


def run_prefix_evicted_then_hit(cache, kv: KVCacheManager, tier: TierConnector,
                                write=None) -> tuple[Request, list[int]]:
    """A's 4 full blocks are written and freed; B takes the whole pool (A's blocks
    offloaded); A again plus one token hits the tier for all four. Returns the new request
    and A's first block ids. `write(block_ids, value)` fills blocks as a forward would."""
    write = write or (lambda ids, v: None)
    a = make_request("a", list(range(4 * BS)))
    kv.allocate_slots(a, 4 * BS)
    a_ids = kv.get_block_ids("a")
    for i, block_id in enumerate(a_ids):
        write([block_id], float(i + 1))
    kv.free(a)
    b = make_request("b", list(range(100, 100 + 5 * BS)))
    kv.allocate_slots(b, 5 * BS)
    write(kv.get_block_ids("b"), -1.0)  # B's forward overwrites every block
    kv.free(b)
    again = make_request("a2", list(range(4 * BS)) + [7])
    computed, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 0
    num_remote = tier.num_remote_tokens(again, num_cached)
    assert num_remote == 4 * BS and tier.loads_locally(again)
    assert kv.allocate_slots(again, num_remote, computed, publish=False) is not None
    tier.start_load(again, kv.get_block_ids("a2"), 0)
    return again, a_ids


def test_an_evicted_block_comes_back_bit_for_bit():
    cache, kv, tier = make_tier()

    def write(ids, value):
        for block_id in ids:
            cache[:, :, block_id] = value

    again, _ = run_prefix_evicted_then_hit(cache, kv, tier, write)
    assert tier.num_loading == 1 and tier.has_pending
    assert tier.poll().loaded == [again]  # the next step copies the blocks and runs it
    for i, block_id in enumerate(kv.get_block_ids("a2")):
        assert torch.equal(cache[:, :, block_id], torch.full_like(cache[:, :, 0], i + 1.0))
    assert tier.num_loading == 0 and not tier.has_pending
    stats = tier.tier_stats()
    assert stats.hit_blocks_total == 4 and stats.hit_tokens_total == 4 * BS
    block_bytes = cache[:, :, 0].numel() * 4
    assert stats.loaded_bytes_total == 4 * block_bytes
    # A's four when B took the pool, then four of B's five when A's load took it back
    assert stats.offloaded_bytes_total == 8 * block_bytes and stats.blocks_held == 8
    kv.free(again)
    kv.check_integrity()


def test_an_ended_request_loading_frees_its_blocks_at_once():
    cache, kv, tier = make_tier()
    again, _ = run_prefix_evicted_then_hit(cache, kv, tier)
    assert tier.request_finished(again, kv.get_block_ids("a2")) == (False, None)
    assert tier.poll().loaded == []
    kv.free(again)
    kv.check_integrity()


def test_the_host_pool_evicts_least_recently_used_and_spares_what_a_load_needs():
    cache = torch.arange(float(torch.Size(SHAPE).numel())).reshape(SHAPE)
    host = HostKVPool(cache, 3)
    for h, block_id in ((10, 0), (11, 1), (12, 2)):
        assert host.store(h, block_id)
    host.touch(10)
    assert host.store(13, 3)  # 11 was least recently used
    assert 11 not in host and len(host) == 3
    assert not host.store(12, 4)  # held: touched, not copied again
    assert not host.store(14, 4, keep={10, 12, 13})  # every held block is needed
    assert host.store(14, 4, keep={10, 13})  # the least recently used of the rest goes
    assert 12 not in host and all(h in host for h in (10, 13, 14))
    host.load(13, 0)  # block 3's KV back into device block 0
    assert torch.equal(cache[:, :, 0], cache[:, :, 3])


def test_the_copy_path_runs_on_meta_with_copies_only():
    meta = torch.device("meta")
    cache, kv, tier = make_tier(device="meta")
    with CopyRecorder(meta) as rec:
        again, _ = run_prefix_evicted_then_hit(cache, kv, tier)
        assert tier.poll().loaded == [again]
    assert rec.host_reads == []
    # 4 + 4 offloads and 4 loads, each one non-blocking copy_
    assert rec.copy_calls == 12 and rec.blocking == 0


class CopyRecorder(Recorder):
    """Counts `copy_` calls (and the blocking ones) and records any call that reads a
    tensor's values back to the host (none may: on meta they would raise)."""

    HOST_READS = ("cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__")

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.host_reads: list[str] = []
        self.copy_calls = self.blocking = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.HOST_READS:
            self.host_reads.append(name)
        if name == "copy_":
            self.copy_calls += 1
            self.blocking += not (kwargs or {}).get("non_blocking", False)
        return super().__torch_function__(func, types, args, kwargs)


def test_a_step_offloads_at_most_its_bound_and_the_next_step_starts_afresh():
    cache = torch.zeros(SHAPE)
    kv = KVCacheManager(SHAPE[2], BS)
    tier = TierConnector(kv, HostKVPool(cache, 16), max_offloads_per_step=2)
    a = make_request("a", list(range(4 * BS)))
    kv.allocate_slots(a, 4 * BS)  # four full blocks, published
    kv.free(a)
    b = make_request("b", list(range(100, 100 + 5 * BS)))
    kv.allocate_slots(b, 5 * BS)  # takes the whole pool: evicts a's four
    stats = tier.tier_stats()
    assert len(tier.host) == 2 and stats.offload_skipped_total == 2
    kv.free(b)
    tier.poll()  # a new step
    assert tier.tier_stats().offload_queue_depth == 2  # what the last step queued
    c = make_request("c", list(range(200, 200 + 2 * BS)))
    kv.allocate_slots(c, 2 * BS)  # evicts two of b's five: within the new step's bound
    assert len(tier.host) == 4 and tier.tier_stats().offload_skipped_total == 2
