"""Sliding windows: exact against transformers beyond the window (Mistral with every layer
sliding), and the KV manager releasing the blocks that fall out of the window — bounded
blocks per request, integrity under random workloads, nothing released while a transfer
owns a request's KV, prefix hits before the window left untouched."""

from __future__ import annotations

import math

import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from baton import LLM, SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.handoff import HoldKV
from baton.engine.request import RequestStatus
from baton.engine.scheduler import SchedulerLimits, make_scheduler
from tests.unit.engine.models.parity import (
    check_parity,
    check_preemption,
    hf_greedy,
    prompts_for,
    save_tiny,
)
from tests.unit.engine.test_scheduler_properties import fake_step, make_request

WINDOW = 24
MISTRAL = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2, sliding_window=WINDOW, tie_word_embeddings=False)


def _mistral(path, model_dir):
    return save_tiny(transformers.MistralConfig(**MISTRAL), transformers.MistralForCausalLM,
                     path, model_dir)


def test_mistral_window_matches_transformers(tmp_path, model_dir):
    """Prompts of 37-150 tokens over a 24-token window, 32-token chunks straddling its edge,
    prefix hits (some before the window), blocks released as requests advance."""
    hf = _mistral(tmp_path, model_dir)
    llm = check_parity(tmp_path, hf, max_tokens=12)
    assert llm.engine.kv.sliding_window == WINDOW


def test_long_generation_holds_a_window_of_blocks(tmp_path, model_dir):
    hf = _mistral(tmp_path, model_dir)
    prompts, max_tokens, bs, chunk = prompts_for(1001, (40, 70)), 90, 8, 16
    # 24 blocks: the two whole sequences need 15 + 20, their windows a few each.
    llm = LLM(str(tmp_path), dtype="float32", block_size=bs, max_num_batched_tokens=chunk,
              num_kv_blocks=24)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    most = {"prefill": 0, "decode": 0}
    while engine.has_unfinished_requests():
        phases = {r.request_id: "decode" if r.num_computed_tokens >= r.num_prompt_tokens
                  else "prefill" for r in reqs}  # what this step runs for each
        engine.step()
        engine.check_integrity()
        for req in reqs:
            if not req.is_finished:
                phase = phases[req.request_id]
                most[phase] = max(most[phase], engine.kv.num_held_blocks(req.request_id))
    assert [r.output_token_ids for r in reqs] == hf_greedy(hf, prompts, max_tokens)
    assert most["decode"] <= math.ceil(WINDOW / bs) + 1, most  # W keys, maybe misaligned
    # A prefill chunk also holds its own tokens' blocks.
    assert most["prefill"] <= math.ceil((WINDOW - 1 + chunk) / bs) + 1, most
    assert engine.scheduler.num_preemptions == 0  # without releasing: preempted
    assert engine.kv.num_used_blocks == 0


def test_preemption_with_released_blocks_keeps_parity(tmp_path, model_dir):
    """A pool of 8 blocks for 4 requests: preempted requests had released blocks."""
    hf = _mistral(tmp_path, model_dir)
    check_preemption(tmp_path, hf, prompts_for(1001, (40, 60, 70, 50)))


def _manager(num_blocks=32, bs=4, window=8):
    return KVCacheManager(num_blocks, bs, True, sliding_window=window)


def _advance(kv, req, n):
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n


def test_released_positions_keep_a_valid_table_row():
    kv = _manager()
    req = make_request(0, 40, 1)
    _advance(kv, req, 20)
    _advance(kv, req, 20)  # queries from 20 on see 13..: blocks 0..2 released
    assert kv.num_held_blocks(req.request_id) == 7
    assert kv.allocate_slots(req, 1) is not None  # position 40 sees 33..40: 0..7 released
    ids = kv.get_block_ids(req.request_id)
    held = ids[8:]
    assert len(ids) == 11 and len(set(held)) == 3 and set(ids[:8]) <= set(held)
    assert kv.num_used_blocks == 3
    kv.check_integrity()
    kv.free(req)
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_nothing_released_while_a_transfer_owns_the_kv():
    kv = _manager()
    held, plain = make_request(0, 40, 1), make_request(1, 40, 1)
    held.kv_handoff = HoldKV()
    for req in (held, plain):
        _advance(kv, req, 20)
        _advance(kv, req, 20)
        _advance(kv, req, 1)
    assert kv.num_held_blocks(held.request_id) == 11
    assert kv.num_held_blocks(plain.request_id) == 3
    kv.check_integrity()


def test_prefix_hits_before_the_window_are_not_taken():
    kv = _manager()
    first = make_request(0, 41, 1)
    _advance(kv, first, 41)
    kv.free(first)  # its 10 full blocks stay cached
    again = make_request(0, 41, 1)
    again.request_id = "again"
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 40
    assert kv.allocate_slots(again, 1, hits) is not None
    # position 40 sees 33..40: hits 0..7 are skipped, 8 and 9 taken, one new block
    assert [b.ref_cnt for b in hits] == [0] * 8 + [1, 1]
    assert kv.num_held_blocks("again") == 3 and kv.num_used_blocks == 3
    kv.check_integrity()


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40)), min_size=1,
                      max_size=10),
       window=st.integers(1, 20), block_size=st.sampled_from([1, 4, 8]),
       num_blocks=st.integers(16, 40), budget=st.integers(1, 40), caching=st.booleans(),
       abort=st.tuples(st.integers(0, 9), st.integers(0, 40)))
def test_random_workloads_release_and_stay_consistent(specs, window, block_size, num_blocks,
                                                      budget, caching, abort):
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window=window)
    sched = make_scheduler(SchedulerLimits(budget, 8, 512), kv)
    for i, (plen, mt) in enumerate(specs):
        sched.add_request(make_request(i, plen, mt, shared_prefix=12 * (i % 2)))
    for step in range(3000):
        if step == abort[1]:
            sched.finish_requests([f"r{abort[0]}"], RequestStatus.FINISHED_ABORTED)
        _, out = fake_step(sched)
        sched.drain_ended()
        kv.check_integrity()
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            tokens = req.num_computed_tokens  # after this step
            assert len(kv.get_block_ids(req.request_id)) == kv.blocks_for(tokens)
            span = window - 1 + s.num_new_tokens  # what this step's queries could see
            assert kv.num_held_blocks(req.request_id) <= -(-span // block_size) + 1
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    assert kv.num_used_blocks == 0
