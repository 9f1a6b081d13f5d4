"""Scheduler + KV pool under random arrivals, lengths, aborts and pool sizes: integrity after
every step, every request ends, and the pool returns to all-free. No model: a fake step
samples a deterministic token for every request that reaches the end of its tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from baton.common.sampling_params import SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler import SchedulerLimits, make_scheduler
from baton.engine.scheduler.static import PAD_TOKEN_ID, PaddingRow

EOS = 0


def make_scheduler_for(policy="fcfs", num_blocks=64, block_size=4, budget=32, max_seqs=8,
                       caching=True, max_model_len=512):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return make_scheduler(SchedulerLimits(budget, max_seqs, max_model_len, policy), kv), kv


def make_request(i: int, prompt_len: int, max_tokens: int, priority: int = 0,
                 shared_prefix: int = 0) -> Request:
    prompt = [1 + (t % 7) for t in range(shared_prefix)] + [100 + i * 13 + t
                                                            for t in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens,
                   eos_token_id=EOS, priority=priority, arrival_time=float(i))


def fake_step(sched) -> list[Request]:
    out = sched.schedule()
    sampled = {s.request.request_id: 1000 + s.request.num_tokens for s in out.scheduled
               if s.samples}
    return sched.update_from_output(out, sampled), out


request_specs = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 1),
              st.integers(0, 6)),  # prompt len, max tokens, priority, shared prefix?, arrival step
    min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(specs=request_specs, policy=st.sampled_from(["fcfs", "priority", "static", "dynamic"]),
       num_blocks=st.integers(14, 40), block_size=st.sampled_from([1, 4, 8]),
       budget=st.integers(1, 48), caching=st.booleans(),
       aborts=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 30)), max_size=4))
def test_random_workloads_finish_and_free_everything(specs, policy, num_blocks, block_size,
                                                     budget, caching, aborts):
    sched, kv = make_scheduler_for(policy, num_blocks, block_size, budget, caching=caching)
    reqs = [make_request(i, plen, mt, prio, 12 * shared)
            for i, (plen, mt, prio, shared, _) in enumerate(specs)]
    arrivals = {i: spec[4] for i, spec in enumerate(specs)}
    abort_at = {f"r{i}": step for i, step in aborts if i < len(reqs)}
    ended: set[str] = set()
    for step in range(2000):
        for i, req in enumerate(reqs):
            if arrivals[i] == step:
                sched.add_request(req)
        for rid, at in abort_at.items():
            if at == step:
                ended.update(r.request_id for r in sched.finish_requests(
                    [rid], RequestStatus.FINISHED_ABORTED))
        finished, _ = fake_step(sched)
        ended.update(r.request_id for r in finished)
        ended.update(r.request_id for r in sched.drain_ended())
        kv.check_integrity()
        if step > max(arrivals.values()) and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests(), "requests left unfinished (a hang)"
    assert ended == {r.request_id for r in reqs}
    assert all(r.is_finished for r in reqs)
    assert kv.num_used_blocks == 0
    for r in reqs:
        if r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens:
            assert r.num_output_tokens <= r.max_tokens


def test_token_budget_and_max_num_seqs_are_respected():
    sched, kv = make_scheduler_for(budget=10, max_seqs=3, num_blocks=200)
    for i in range(6):
        sched.add_request(make_request(i, 25, 4))
    seen_running = 0
    while sched.has_unfinished_requests():
        _, out = fake_step(sched)
        assert out.num_tokens <= 10
        seen_running = max(seen_running, sched.num_running)
    assert seen_running <= 3


def test_prompt_is_chunked_across_steps():
    sched, _ = make_scheduler_for(budget=8, num_blocks=100)
    req = make_request(0, 30, 2)
    sched.add_request(req)
    chunks = []
    while req.num_output_tokens == 0:
        _, out = fake_step(sched)
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [8, 8, 8, 6]


def test_running_requests_are_served_before_new_ones():
    sched, _ = make_scheduler_for(budget=4, num_blocks=100)
    first = make_request(0, 3, 5)
    sched.add_request(first)
    fake_step(sched)  # prefill of `first`
    sched.add_request(make_request(1, 20, 5))
    _, out = fake_step(sched)
    assert out.scheduled[0].request is first and out.scheduled[0].num_new_tokens == 1
    assert out.scheduled[1].num_new_tokens == 3  # the rest of the budget goes to the newcomer


def test_priority_policy_admits_and_preempts_by_priority():
    sched, kv = make_scheduler_for("priority", num_blocks=6, block_size=4, budget=64)
    low = make_request(0, 8, 12, priority=5)
    sched.add_request(low)
    fake_step(sched)
    high = make_request(1, 8, 12, priority=0)
    sched.add_request(high)
    fake_step(sched)
    preempted = set()
    while sched.has_unfinished_requests():
        _, out = fake_step(sched)
        preempted.update(r.request_id for r in out.preempted)
        kv.check_integrity()
    assert "r0" in preempted and "r1" not in preempted
    assert high.num_output_tokens == 12 and low.num_output_tokens == 12


def test_finished_requests_leave_in_the_step_they_finish():
    sched, kv = make_scheduler_for(num_blocks=50)
    req = make_request(0, 5, 1)
    sched.add_request(req)
    finished, _ = fake_step(sched)
    assert finished == [req] and sched.num_running == 0 and kv.num_used_blocks == 0


def test_prefix_cache_hit_skips_computed_blocks():
    sched, kv = make_scheduler_for(num_blocks=50, block_size=4)
    a = make_request(0, 2, 1, shared_prefix=12)
    sched.add_request(a)
    while sched.has_unfinished_requests():
        fake_step(sched)
    b = make_request(1, 3, 1, shared_prefix=12)
    sched.add_request(b)
    _, out = fake_step(sched)
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_new_tokens == 3


def test_request_too_big_for_the_pool_ends_with_length():
    sched, kv = make_scheduler_for(num_blocks=3, block_size=4)
    req = make_request(0, 10, 20)
    sched.add_request(req)
    for _ in range(50):
        fake_step(sched)
        sched.drain_ended()
        if not sched.has_unfinished_requests():
            break
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and kv.num_used_blocks == 0


def test_static_policy_runs_groups_to_completion_with_padding():
    sched, kv = make_scheduler_for("static", num_blocks=100, max_seqs=2)
    short, long_, third = make_request(0, 4, 2), make_request(1, 9, 6), make_request(2, 4, 2)
    for r in (short, long_, third):
        sched.add_request(r)
    # The prefill step pads the shorter prompt to the group's longest.
    _, out = fake_step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(short, 4), (long_, 9)]
    assert [(s.request, s.num_new_tokens) for s in out.padding] == [(short, 5)]
    padded_steps = 0
    while not long_.is_finished:
        _, out = fake_step(sched)
        assert third.status == RequestStatus.WAITING  # nobody joins a running group
        padded_steps += any(isinstance(s, PaddingRow) for s in out.rows)
    assert padded_steps == 4 and short.num_output_tokens == 2
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert third.num_output_tokens == 2 and kv.num_used_blocks == 0


def test_static_prompt_padding_is_computed_but_writes_and_samples_nothing():
    import torch

    from baton.engine.runner.batch import build_batch

    sched, kv = make_scheduler_for("static", num_blocks=100, max_seqs=2)
    short, long_ = make_request(0, 3, 2), make_request(1, 10, 2)
    for r in (short, long_):
        sched.add_request(r)
    out = sched.schedule()
    batch = build_batch(out.rows, kv.get_block_ids, 4, torch.device("cpu"))
    rows = {(e.request.request_id, isinstance(e, PaddingRow)): (batch.layout.query_start_loc[i],
                                                   batch.layout.query_start_loc[i + 1], i)
            for i, e in enumerate(batch.entries)}
    start, end, i = rows[("r0", True)]
    assert end - start == 7  # 10 - 3
    assert batch.input_ids[start:end].tolist() == [PAD_TOKEN_ID] * 7
    assert batch.positions[start:end].tolist() == list(range(7))
    assert batch.layout.slot_mapping[start:end].tolist() == [-1] * 7
    assert (batch.layout.context_lens[i], batch.layout.seq_lens[i]) == (0, 7)
    # Its table row reads only blocks of the batch's table (the longest prompt's width).
    assert batch.layout.block_tables.shape[1] >= -(-7 // 4)
    assert [e.request.request_id for e in batch.sampling_entries] == ["r0", "r1"]
    real = [e for e in batch.entries if not isinstance(e, PaddingRow)]
    written = batch.layout.slot_mapping[batch.layout.slot_mapping >= 0]
    assert len(written) == sum(e.num_new_tokens for e in real) == 13


def test_dynamic_policy_collects_a_group_within_its_window():
    import time

    kv = KVCacheManager(100, 4, True)
    sched = make_scheduler(SchedulerLimits(64, 3, 512, "dynamic", batch_window_s=0.05), kv)
    now = time.monotonic()
    first, second, third, fourth = (
        Request(f"d{i}", [100 + i, 7, 8], SamplingParams(max_tokens=2), max_tokens=2,
                eos_token_id=EOS, arrival_time=now) for i in range(4))
    for r in (first, second):
        sched.add_request(r)
    assert sched.schedule().is_empty and 0 < sched.idle_for() <= 0.05  # still collecting
    sched.add_request(third)  # max_num_seqs wait: the group starts at once
    assert sched.idle_for() == 0
    _, out = fake_step(sched)
    assert [s.request for s in out.scheduled] == [first, second, third]
    sched.add_request(fourth)
    while not third.is_finished:
        _, out = fake_step(sched)
        assert fourth.status == RequestStatus.WAITING  # nobody joins a running group
    fourth.arrival_time = time.monotonic()
    assert fake_step(sched)[1].is_empty and sched.idle_for() > 0  # its own window
    time.sleep(sched.idle_for())
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert fourth.num_output_tokens == 2 and kv.num_used_blocks == 0
