"""Async scheduling (`engine.step_pipeline`): step N+1 is scheduled and launched before step
N's tokens are read. On the simulated device the order of launches and reads is checked and
every request still gets its exact length, with nothing leaked; with the bundled model on
CPU (a synchronous runner, where the engine writes each step's tokens in before the next
launches) every output — greedy and seeded tokens, text, stop strings, penalties, logprobs,
structured outputs, preemption, chunked prefill, prefix hits, aborts — is the one the
synchronous engine gives."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from baton import LLM, SamplingParams
from baton.common.sampling_params import StructuredOutput
from baton.engine.config import SpeculativeConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import PENDING, Request, RequestStatus
from baton.engine.scheduler import SchedulerLimits, make_scheduler
from tests.conftest import parity_prompts

SIM = {"device": "sim", "sim_profile": "h100-llama3-8b"}


# -- the bookkeeping, without a model ------------------------------------------------------
def _request(rid: str, n: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens),
                   max_tokens=max_tokens)


def test_a_pending_token_holds_its_place_until_read_and_is_dropped_when_the_request_ends():
    req = _request("a", 5)
    req.add_pending()
    req.add_pending()
    assert req.output_token_ids == [PENDING, PENDING] and req.num_known_tokens == 5
    req.resolve_pending(7)
    assert req.output_token_ids == [7, PENDING] and req.num_pending == 1
    req.drop_pending()
    assert req.output_token_ids == [7] and req.num_tokens == 6 and req.num_known_tokens == 6


def test_a_block_is_published_only_once_its_pending_token_is_known():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    req = _request("a", 7)
    assert kv.allocate_slots(req, 7) is not None
    req.num_computed_tokens = 7
    req.add_pending()  # position 7 ends the second block, its token not known yet
    kv.allocate_slots(req, 1)
    assert len(kv.cached_blocks()) == 1  # the first block only
    req.resolve_pending(42)
    req.num_computed_tokens = 8
    req.add_pending()
    kv.allocate_slots(req, 1)
    assert len(kv.cached_blocks()) == 2
    other = _request("b", 9)
    other.prompt_token_ids[:8] = [*range(100, 107), 42]
    assert kv.get_computed_blocks(other)[1] == 8  # the hash has the token read, not PENDING


def test_a_request_whose_pending_token_is_its_last_is_not_scheduled_again():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    sched = make_scheduler(SchedulerLimits(64, 4, 64), kv)
    last, more = _request("last", 4, max_tokens=1), _request("more", 4, max_tokens=3)
    for req in (last, more):
        sched.add_request(req)
    first = sched.schedule()
    for s in first.scheduled:  # launched: counters advance, each samples a pending token
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.add_pending()
    second = sched.schedule()
    assert [s.request.request_id for s in second.scheduled] == ["more"]
    ended = sched.resolve_pending([last, more], {"last": [5], "more": [6]}, {})
    assert ended == [last] and last.output_token_ids == [5]
    assert more.output_token_ids == [6] and more.num_pending == 0


def test_a_request_alone_out_of_room_waits_for_its_token_in_flight_before_it_ends():
    # 4 blocks of 4: "a" holds 3 and needs a 4th for its next token, which another holder
    # (a KV load, a lease) has; alone, it can never fit — but its token in flight decides
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    sched = make_scheduler(SchedulerLimits(64, 4, 64), kv)
    a = _request("a", 12)
    sched.add_request(a)
    first = sched.schedule()
    assert [s.num_new_tokens for s in first.scheduled] == [12]
    a.num_computed_tokens = 12
    a.add_pending()
    assert kv.allocate_slots(_request("holder", 4), 4) is not None
    assert sched.schedule().is_empty and a.status == RequestStatus.RUNNING
    assert sched.resolve_pending([a], {"a": [5]}, {}) == []
    sched.schedule()  # now it ends: "length", with the token it sampled
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [5]
    assert sched.drain_ended() == [a]


# -- the simulated device ------------------------------------------------------------------
def test_the_next_step_launches_before_the_last_ones_tokens_are_read():
    llm = LLM(**SIM, max_num_seqs=8)
    core = llm.engine
    assert core.async_scheduling  # auto: the simulated device runs steps asynchronously
    events: list[str] = []
    launch = core.runner.launch

    def traced_launch(out, block_ids_of, since=None):
        n = sum(e.startswith("launch") for e in events) + 1
        events.append(f"launch {n}")
        handle = launch(out, block_ids_of, since)
        read = handle.result

        def traced_read():
            events.append(f"read {n}")
            return read()
        handle.result = traced_read
        return handle

    core.runner.launch = traced_launch
    outs = llm.generate([[100 + i] * 40 for i in range(4)], SamplingParams(max_tokens=6),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 4
    assert events[:5] == ["launch 1", "launch 2", "read 1", "launch 3", "read 2"]
    core.check_integrity()
    assert core.kv.num_used_blocks == 0


def test_requests_keep_exact_lengths_and_blocks_through_aborts_and_preemption():
    # a pool of 40 blocks of 16 for 12 requests growing to 200+ tokens: preemptions
    llm = LLM(**SIM, max_num_seqs=12, num_kv_blocks=40, block_size=16)
    core = llm.engine
    params = [SamplingParams(max_tokens=30 + 7 * i, ignore_eos=True) for i in range(12)]
    reqs = [core.add_request(f"r{i}", [200 + i] * (60 + 10 * i), p)
            for i, p in enumerate(params)]
    done: dict[str, list[int]] = {}
    for step in range(2000):
        if step == 5:
            core.abort_requests(["r3", "r7"])
        for out in core.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not core.has_unfinished_requests():
            break
    assert core.scheduler.num_preemptions > 0
    for i, req in enumerate(reqs):
        assert PENDING not in req.output_token_ids
        if req.request_id not in ("r3", "r7"):
            assert len(done[req.request_id]) == 30 + 7 * i == req.num_output_tokens
    core.step()  # the step still in flight, if any, is read: nothing is left held
    core.check_integrity()
    assert core.kv.num_used_blocks == 0


def test_the_device_is_idle_only_for_what_the_host_did_not_overlap():
    prompts = [[300 + i] * 200 for i in range(32)]
    busy = {}
    for mode in (False, True):
        llm = LLM(**SIM, max_num_seqs=32, async_scheduling=mode)
        llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
        timing = llm.engine.timing
        assert 0 < timing.busy_fraction <= 1.0 and timing.host_s >= 0
        busy[mode] = timing.busy_fraction
    assert busy[True] > busy[False]


def test_an_idle_engine_keeps_no_step_in_flight_and_its_idleness_is_not_host_time():
    llm = LLM(**SIM, max_num_seqs=4)
    core = llm.engine
    core.add_request("a", [100] * 50, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        core.step()
    assert core.abort_requests(["a"])[0].finish_reason == "abort"
    time.sleep(0.3)  # idle: nothing to do, no step owed
    before = core.timing.snapshot()
    outs = llm.generate([[200] * 30], SamplingParams(max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 5
    assert core.timing.host_s - before.host_s < 0.1
    core.check_integrity()
    assert core.kv.num_used_blocks == 0


def test_modes_that_need_each_steps_tokens_refuse_it():
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(**SIM, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="static policy"):
        LLM(**SIM, async_scheduling=True, scheduling_policy="static")
    core = LLM(**SIM).engine
    live = core.config.live_settings
    spec = replace(live.scheduler, speculative=SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="schedules asynchronously"):
        core.reconfigure(replace(live, scheduler=spec))
    assert not LLM(**SIM, scheduling_policy="dynamic").engine.async_scheduling


# -- the bundled model: the same outputs as the synchronous engine ------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"]}


def _workload(tokenizer):
    prompts = [tokenizer.encode(p) for p in parity_prompts()[:10] + parity_prompts()[2:3]]
    params = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=40, stop=[" the", "."]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3,
                       frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=16, n=2),
        SamplingParams(temperature=0, max_tokens=64, min_tokens=4),  # may end at EOS
        SamplingParams(temperature=0, max_tokens=40,
                       structured=StructuredOutput("json_schema", json.dumps(SCHEMA))),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[13, 30]),
        # penalised and sampled: on the device path its pending token is read there
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, presence_penalty=1.2,
                       repetition_penalty=1.2, logprobs=1),
    ]
    return prompts, params


def _outputs(llm, prompts, params, approx: bool):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0
    return [(o.num_cached_tokens, _values(o.prompt_logprobs, approx),
             [(c.token_ids, c.text, c.finish_reason, c.stop_reason, _values(c.logprobs, approx))
              for c in o.outputs]) for o in outs]


def _values(lps, approx: bool):
    """Logprobs as (token, value) pairs; `approx`: values to float noise (a step's batch
    differs between the modes, and the CPU's kernels round by batch shape)."""
    return None if lps is None else [
        None if lp is None else (lp.token_id, pytest.approx(lp.logprob, abs=1e-4) if approx
                                 else lp.logprob) for lp in lps]


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 96, "block_size": 16},  # chunked prefill, prefix hits
    {"num_kv_blocks": 48, "block_size": 16, "enable_prefix_caching": False},  # preemption
], ids=["chunked", "preempting"])
def test_the_bundled_model_gives_the_synchronous_engines_outputs(tokenizer, engine_args):
    prompts, params = _workload(tokenizer)
    prompts, params = prompts + prompts[:4], params + params[:4]  # again: prefix hits
    got = {}
    # sync; async with the step's tokens written in on the host (a synchronous runner);
    # async with the pending inputs taken from the last step's token tensor, as on CUDA
    for mode in ("sync", "host", "device"):  # sync: `auto`, which a CPU runner leaves off
        llm = LLM(dtype="float32", async_scheduling=None if mode == "sync" else True,
                  **engine_args)
        assert llm.engine.async_scheduling is (mode != "sync")
        llm.engine.runner.launches_async = mode == "device"
        got[mode] = _outputs(llm, prompts, params, approx=mode == "sync")
        if "num_kv_blocks" in engine_args:
            assert llm.engine.scheduler.num_preemptions > 0
    assert got["host"] == got["sync"]
    assert got["device"] == got["sync"]
    assert got["host"][6][2][0][1].startswith("{")  # the structured one held its schema


@pytest.mark.slow
def test_penalties_read_the_pending_token_on_the_device_path(tokenizer):
    """Penalised requests alone: no step is read at once, so each step's penalties count
    the token the step before sampled, read from its token tensor on the device."""
    prompts = [tokenizer.encode(p) for p in parity_prompts()[:6]]
    params = [SamplingParams(temperature=0, max_tokens=32, presence_penalty=2.0,
                             frequency_penalty=1.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.8, seed=7, max_tokens=32, repetition_penalty=3.0)]
    params = [params[i % 2] for i in range(len(prompts))]
    got = {}
    for mode in ("sync", "device"):
        llm = LLM(dtype="float32", async_scheduling=mode != "sync")
        llm.engine.runner.launches_async = mode == "device"
        got[mode] = _outputs(llm, prompts, params, approx=True)
    assert got["device"] == got["sync"]
