"""The scheduler through the KV connector seam, with a scripted connector behind the
`KVConnector` interface: loads that finish, fail or are aborted mid-way, prefills held for a
puller. Every path ends with each block back in the pool."""

from __future__ import annotations

import random

import pytest

from baton.common.internal import KVTransferParams
from baton.common.sampling_params import SamplingParams
from baton.engine.config import LiveKVSettings
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector import HoldKV, PullKV
from baton.engine.kv_connector.base import KVConnector, KVConnectorStats, KVUpdates
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler import SchedulerLimits, make_scheduler

EOS = 999_999
PARAMS = KVTransferParams.model_validate({
    "block_ids": [0], "first_token": 7, "lease_id": "l", "num_tokens": 1, "lease_ttl_s": 30,
    "endpoint": {"transport": "fake", "engine_id": "e", "address": "-", "layout": {
        "num_layers": 1, "block_size": 4, "num_kv_heads": 1, "head_dim": 8,
        "dtype": "float32"}}})


class ScriptedConnector(KVConnector):
    """Loads finish after `polls` polls, or fail when their request id is in `fail`."""

    def __init__(self, polls: int = 2, fail: set[str] = frozenset(),
                 policy: str = "recompute") -> None:
        self.polls, self.fail, self.policy = polls, set(fail), policy
        self.stats = KVConnectorStats()
        self.loading: dict[str, list] = {}  # rid -> [polls left, request, aborted]
        self.held: dict[str, Request] = {}
        self.released: list[str] = []  # leases the puller is done with
        self.loads: dict[str, list[int]] = {}  # rid -> the blocks it was asked to fill

    def num_remote_tokens(self, req, num_cached):
        return req.num_prompt_tokens - num_cached if isinstance(req.kv_handoff, PullKV) else 0

    def start_load(self, req, block_ids, num_cached):
        self.loads[req.request_id] = list(block_ids)
        self.loading[req.request_id] = [self.polls, req, False]

    @property
    def num_loading(self):
        return sum(1 for _, _, aborted in self.loading.values() if not aborted)

    def poll(self):
        up = KVUpdates()
        for rid in self.released:
            up.freeable.append(self.held.pop(rid))
        self.released = []
        for rid, entry in list(self.loading.items()):
            entry[0] -= 1
            if entry[0] > 0:
                continue
            del self.loading[rid]
            req, aborted = entry[1], entry[2]
            if aborted:
                up.freeable.append(req)
            elif rid not in self.fail:
                up.loaded.append(req)
            elif self.policy == "recompute":
                up.recompute.append(req)
            else:
                up.failed.append((req, "KV transfer failed: scripted"))
        return up

    @property
    def has_pending(self):
        return bool(self.loading or self.held)

    def request_finished(self, req, block_ids):
        if req.request_id in self.loading:
            self.loading[req.request_id][2] = True
            return True, None
        if isinstance(req.kv_handoff, HoldKV) and req.status in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            self.held[req.request_id] = req
            return True, PARAMS
        return False, None

    def reconfigure(self, live: LiveKVSettings):
        self.policy = live.failure_policy

    def take_transfer_durations(self):
        return []

    @property
    def num_leases_held(self):
        return len(self.held)

    def close(self):
        pass


def setup(connector: KVConnector, num_blocks=64, max_seqs=8, budget=32):
    kv = KVCacheManager(num_blocks, 4, True)
    return make_scheduler(SchedulerLimits(budget, max_seqs, 512), kv, connector), kv


def request(i: int, prompt_len: int, max_tokens: int, kv=None) -> Request:
    req = Request(f"r{i}", [100 + 7 * i + t for t in range(prompt_len)],
                  SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                  eos_token_id=EOS, arrival_time=float(i))
    req.kv_handoff = kv
    if isinstance(kv, PullKV):
        req.output_token_ids.append(kv.params.first_token)
    return req


def step(sched):
    out = sched.schedule()
    sampled = {s.request.request_id: 1000 + s.request.num_tokens for s in out.scheduled
               if s.samples}
    return sched.update_from_output(out, sampled), out


def drain(sched, kv, steps=200):
    for _ in range(steps):
        if not (sched.has_unfinished_requests() or sched.needs_polling):
            break
        step(sched)
        sched.drain_ended()
    assert not sched.has_unfinished_requests() and not sched.needs_polling
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_pulled_request_waits_for_its_kv_then_decodes():
    conn = ScriptedConnector(polls=1)  # done at the first poll after it started
    sched, kv = setup(conn, max_seqs=1)
    pulled, local = request(0, 10, 3, PullKV(PARAMS)), request(1, 5, 2)
    sched.add_request(pulled)
    sched.add_request(local)
    _, out = step(sched)
    assert pulled.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert out.scheduled == []  # its prompt is not computed, and it holds the only seat
    assert len(conn.loads["r0"]) == kv.blocks_for(10)
    _, out = step(sched)  # the load finished at this step's poll: it decodes at once
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(pulled, 1)]
    assert pulled.num_computed_tokens == 11 and pulled.kv_handoff is None
    drain(sched, kv)
    assert pulled.num_output_tokens == 3 and local.num_output_tokens == 2


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_recomputes_or_ends_the_request(policy):
    conn = ScriptedConnector(polls=1, fail={"r0"}, policy=policy)
    sched, kv = setup(conn)
    req = request(0, 9, 3, PullKV(PARAMS))
    sched.add_request(req)
    step(sched)
    _, out = step(sched)
    if policy == "recompute":  # prefilled locally from the front, keeping its first token
        assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(req, 10)]
        drain(sched, kv)
        assert req.num_output_tokens == 3 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    else:
        assert sched.drain_ended() == [req] and req.status == RequestStatus.FINISHED_ABORTED
        assert "scripted" in req.stop_reason
        drain(sched, kv)


def test_abort_mid_load_keeps_blocks_until_the_load_stops():
    conn = ScriptedConnector(polls=3)
    sched, kv = setup(conn)
    req = request(0, 12, 4, PullKV(PARAMS))
    sched.add_request(req)
    step(sched)
    assert sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED) == [req]
    assert kv.num_used_blocks == kv.blocks_for(12)  # the load may still write into them
    drain(sched, kv)


def test_held_prefill_keeps_its_blocks_until_the_lease_ends():
    conn = ScriptedConnector()
    sched, kv = setup(conn)
    req = request(0, 9, 1, HoldKV())
    sched.add_request(req)
    finished, _ = step(sched)
    assert finished == [req] and req.kv_transfer_params == PARAMS
    assert kv.num_used_blocks == kv.blocks_for(10) and sched.needs_polling
    conn.released.append("r0")
    drain(sched, kv)
    # Aborted instead of finished: nothing to hand over, the blocks go at once.
    req = request(1, 9, 5, HoldKV())
    sched.add_request(req)
    step(sched)
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert req.kv_transfer_params is None and kv.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_mixes_of_loads_failures_and_aborts_leak_nothing(seed):
    rng = random.Random(seed)
    fail = {f"r{i}" for i in range(30) if rng.random() < 0.3}
    conn = ScriptedConnector(polls=rng.randint(1, 3), fail=fail,
                             policy=rng.choice(["recompute", "fail"]))
    sched, kv = setup(conn, num_blocks=rng.randint(20, 40), max_seqs=rng.randint(2, 6),
                      budget=rng.randint(8, 32))
    reqs = [request(i, rng.randint(1, 20), rng.randint(1, 6),
                    rng.choice([None, PullKV(PARAMS), HoldKV()])) for i in range(30)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(300):
        if rng.random() < 0.1:
            sched.finish_requests([rng.choice(reqs).request_id], RequestStatus.FINISHED_ABORTED)
        conn.released.extend(conn.held)  # pullers come for every held prefill
        step(sched)
        sched.drain_ended()
        kv.check_integrity()
        if not (sched.has_unfinished_requests() or sched.needs_polling):
            break
    drain(sched, kv)
    assert all(r.is_finished for r in reqs)


def test_requests_loading_kv_count_against_max_loras():
    """A request whose KV is loading joins the running batch without asking again, so its
    adapter is held from admission: with one slot, a request of another adapter waits for
    it, and no step ever holds two adapters (the engine could not run that step)."""
    from baton.engine.lora.adapter import LoRAAdapter

    kv = KVCacheManager(64, 4, True)
    sched = make_scheduler(SchedulerLimits(32, 8, 512, max_loras=1), kv,
                           ScriptedConnector(polls=3))
    pulled, local = request(0, 10, 3, PullKV(PARAMS)), request(1, 5, 4)
    pulled.lora = LoRAAdapter("x", "/x", 1, "dx", 8, {})
    local.lora = LoRAAdapter("y", "/y", 2, "dy", 8, {})
    sched.add_request(pulled)
    sched.add_request(local)
    for _ in range(40):
        if not (sched.has_unfinished_requests() or sched.needs_polling):
            break
        _, out = step(sched)
        sched.drain_ended()
        assert len({s.request.lora.load_id for s in out.scheduled}) <= 1
    assert pulled.is_finished and local.is_finished
    assert kv.num_used_blocks == 0
