"""The scheduler with the host tier under random conversations, pool and tier sizes, and
aborts, no model: a fake forward writes each token's id as its KV and checks, before every
step, that each scheduled request's computed tokens hold their ids — so a block the tier
loaded back carries exactly the KV it evicted. Integrity after every step, every request
ends, the pool returns to all-free, and the tier never holds more than its size; the same
over a disk tier whose files get damaged."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.common.sampling_params import SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import DiskKVPool, HostKVPool, TierConnector
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler import SchedulerLimits, make_scheduler

EOS = 0


def make_request(i: int, base: int, prompt_len: int, max_tokens: int) -> Request:
    """Conversation `base`'s first `prompt_len` tokens: requests of one base share them."""
    prompt = [100 + base * 1000 + t for t in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens, eos_token_id=EOS, arrival_time=float(i))


def fake_forward(sched, cache: torch.Tensor, block_size: int) -> list[Request]:
    """One step: check the KV each scheduled request reads, write what it computes, sample
    a token for those at the end of their known tokens."""
    out = sched.schedule()
    sampled = {}
    for s in out.scheduled:
        req, ids = s.request, sched.kv.get_block_ids(s.request.request_id)
        start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
        tokens = req.token_ids(0, min(end, req.num_tokens))
        for pos, token in enumerate(tokens):
            block, off = ids[pos // block_size], pos % block_size
            if pos < start:
                assert cache[0, 0, block, off, 0, 0] == token, (req.request_id, pos)
            else:
                cache[0, 0, block, off, 0, 0] = token
        if s.samples:
            sampled[req.request_id] = 50_000 + req.num_tokens
    return sched.update_from_output(out, sampled)


conversations = st.lists(
    st.tuples(st.integers(0, 2), st.integers(5, 60), st.integers(1, 8), st.integers(0, 10)),
    min_size=1, max_size=12)  # conversation, prompt length, max tokens, arrival step


@settings(max_examples=50, deadline=None)
@given(specs=conversations, num_blocks=st.integers(16, 32), host_blocks=st.integers(1, 24),
       block_size=st.sampled_from([1, 4, 8]), budget=st.integers(4, 48),
       aborts=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 30)), max_size=3))
def test_random_conversations_load_the_kv_they_evicted(specs, num_blocks, host_blocks,
                                                       block_size, budget, aborts):
    cache = torch.full((1, 2, num_blocks, block_size, 1, 1), -1.0, dtype=torch.float64)
    kv = KVCacheManager(num_blocks, block_size)
    tier = TierConnector(kv, HostKVPool(cache, host_blocks), max_offloads_per_step=6)
    drive(cache, kv, tier, specs, budget, aborts)
    assert len(tier.host) <= host_blocks


@settings(max_examples=25, deadline=None)
@given(specs=conversations, host_blocks=st.integers(1, 12), disk_blocks=st.integers(1, 40),
       loads=st.integers(1, 8), spills=st.integers(1, 4),
       aborts=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 30)), max_size=3),
       damage=st.lists(st.integers(0, 40), max_size=4))
def test_random_conversations_over_a_damaged_disk_tier(tmp_path_factory, specs, host_blocks,
                                                       disk_blocks, loads, spills, aborts,
                                                       damage):
    """The same with a disk tier under a small host tier (its spills and reads on the
    worker, its queue and the per-step loads bounded), some of its files garbled on the
    way: a damaged block is computed again, never read."""
    block_size, num_blocks = 4, 20
    cache = torch.full((1, 2, num_blocks, block_size, 1, 1), -1.0, dtype=torch.float64)
    kv = KVCacheManager(num_blocks, block_size)
    disk = DiskKVPool(tmp_path_factory.mktemp("disk"), "fp", block_size * 2 * 8, disk_blocks)
    host = HostKVPool(cache, host_blocks, disk=disk, max_queued_spills=spills)
    tier = TierConnector(kv, host, max_offloads_per_step=6, max_loads_per_step=loads)

    def before_step(step: int) -> None:
        assert host.io is not None and host.io.wait_idle(10)  # every read lands in order
        if step in damage:
            for path in sorted(disk.dir.glob("*.kv"))[:1]:
                path.write_bytes(path.read_bytes()[:-1] + b"\xff")

    drive(cache, kv, tier, specs, 24, aborts, before_step)
    assert len(host) <= host_blocks and len(disk) <= disk_blocks
    tier.close()


def drive(cache, kv, tier, specs, budget, aborts, before_step=lambda step: None) -> None:
    """Run the conversations through a scheduler over the tier until every request ended,
    checking the pool's integrity after every step; the pool ends all free."""
    block_size = kv.block_size
    sched = make_scheduler(SchedulerLimits(budget, 4, 512), kv, tier)
    reqs = [make_request(i, base, plen, mt) for i, (base, plen, mt, _) in enumerate(specs)]
    arrivals = {i: spec[3] for i, spec in enumerate(specs)}
    abort_at = {f"r{i}": step for i, step in aborts if i < len(reqs)}
    ended: set[str] = set()
    for step in range(3000):
        for i, req in enumerate(reqs):
            if arrivals[i] == step:
                sched.add_request(req)
        for rid, at in abort_at.items():
            if at == step:
                ended.update(r.request_id for r in sched.finish_requests(
                    [rid], RequestStatus.FINISHED_ABORTED))
        before_step(step)
        ended.update(r.request_id for r in fake_forward(sched, cache, block_size))
        ended.update(r.request_id for r in sched.drain_ended())
        kv.check_integrity()
        if step > max(arrivals.values()) and not sched.has_unfinished_requests():
            break
    assert ended == {r.request_id for r in reqs}
    assert kv.num_used_blocks == 0 and tier.num_loading == 0 and not tier.loads.pinned
    stats = tier.tier_stats()
    assert stats.hit_tokens_total == stats.hit_blocks_total * block_size


def test_a_second_turn_after_eviction_loads_from_the_tier():
    """The scripted case the random one may miss: a conversation, a flood that turns the
    pool over, the conversation again with more tokens."""
    block_size, num_blocks = 4, 16
    cache = torch.full((1, 2, num_blocks, block_size, 1, 1), -1.0, dtype=torch.float64)
    kv = KVCacheManager(num_blocks, block_size)
    tier = TierConnector(kv, HostKVPool(cache, 32))
    sched = make_scheduler(SchedulerLimits(64, 4, 512), kv, tier)
    for i, (base, n) in enumerate([(0, 30), (1, 60), (2, 60), (0, 40)]):
        req = make_request(i, base, n, 2)
        sched.add_request(req)
        while sched.has_unfinished_requests():
            fake_forward(sched, cache, block_size)
        kv.check_integrity()
    assert req.num_cached_tokens == 28  # 7 of the first turn's blocks, all from the tier
    assert tier.tier_stats().hit_blocks_total == 7
