"""Disaggregation between engines of different tensor-parallel degrees over tcp on loopback
(rank 0 in this process, rank 1 a child): each decode rank pulls the KV heads it owns from
the prefill rank(s) holding them. Greedy tokens equal colocated TP=1; no block or lease is
left behind on any rank."""

from __future__ import annotations

import time

import pytest
import transformers

from baton import SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore
from baton.engine.kv_connector import HoldKV, PullKV
from tests.unit.engine.models.parity import prompts_for, save_tiny
from tests.unit.engine.test_tensor_parallel import COMMON

pytestmark = pytest.mark.slow

N = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny-tp")
    save_tiny(transformers.LlamaConfig(**(COMMON | dict(num_key_value_heads=2))),
              transformers.LlamaForCausalLM, path, model_dir)
    return str(path)


def engine(model: str, tp: int, transport: str | None = "tcp", **kw) -> EngineCore:
    return EngineCore(EngineConfig.from_args(model=model, dtype="float32", block_size=16,
                                   num_kv_blocks=64, num_threads=1, kv_transport=transport,
                                   tensor_parallel_size=tp, **kw))


def run(core: EngineCore, timeout: float = 60.0):
    outs = []
    deadline = time.monotonic() + timeout
    while (core.has_unfinished_requests() or core.needs_polling) and time.monotonic() < deadline:
        outs += core.step()
        time.sleep(0.001)
    return outs


def tokens_of(outs, rid):
    return [t for o in outs if o.request_id == rid for t in o.new_token_ids]


def prefill(p: EngineCore, rid: str, ids: list[int]):
    p.add(p.make_request(rid, ids, SamplingParams(temperature=0, max_tokens=1), kv=HoldKV()))
    while True:  # not `run`: that would wait for the lease to end
        for o in p.step():
            if o.request_id == rid and o.finished:
                assert o.kv_transfer_params is not None
                return o.kv_transfer_params


def decode(d: EngineCore, rid: str, ids: list[int], params):
    req = d.make_request(rid, ids, SamplingParams(temperature=0, max_tokens=N,
                                                  ignore_eos=True), kv=PullKV(params))
    return tokens_of(d.add(req) + run(d), rid)


def settle(*cores: EngineCore) -> None:
    for core in cores:
        deadline = time.monotonic() + 10
        while (core.kv.num_used_blocks or core.connector.num_leases_held) and \
                time.monotonic() < deadline:
            core.step()
            time.sleep(0.01)
        assert core.kv.num_used_blocks == 0 and core.connector.num_leases_held == 0
        assert len(core.connector.transport.leases) == 0
        core.check_integrity()


@pytest.fixture(scope="module")
def expected(tiny):
    c = engine(tiny, 1, transport=None)
    try:
        out = {}
        for i, ids in enumerate(prompts_for(1001, (5, 40, 70))):
            c.add_request(f"c{i}", ids, SamplingParams(temperature=0, max_tokens=N,
                                                       ignore_eos=True))
            out[i] = (ids, tokens_of(run(c), f"c{i}"))
        return out
    finally:
        c.close()


@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 1), (2, 2)])
def test_pull_across_tp_degrees_equals_colocated(tiny, expected, ptp, dtp):
    p, d = engine(tiny, ptp), engine(tiny, dtp)
    try:
        for i, (ids, want) in expected.items():
            params = prefill(p, f"p{i}", ids)
            assert (params.rank_endpoints is None) == (ptp == 1)
            got = decode(d, f"d{i}", ids, params)
            assert got == want, (i, got, want)
        assert d.connector.stats.failures == 0 and d.connector.stats.bytes > 0
        # stopped on the prefill's token: nothing pulled, every holder rank's lease copy
        # released at once (not after the 30 s TTL)
        ids, _ = expected[0]
        params = prefill(p, "p-released", ids)
        req = d.make_request("d-released", ids, SamplingParams(temperature=0, max_tokens=1),
                             kv=PullKV(params))
        assert [o.finished for o in d.add(req) + run(d)] == [True]
        settle(p, d)
    finally:
        p.close()
        d.close()


def test_incompatible_layout_refused_with_the_reason(tiny, expected, tmp_path, model_dir,
                                                      caplog):
    """A decode pod of another model shape (1 KV head, the holder 2) refuses the holder's
    blocks before anything moves and prefills locally; the unpulled lease expires on every
    prefill rank and frees its blocks."""
    save_tiny(transformers.LlamaConfig(**(COMMON | dict(num_key_value_heads=1))),
              transformers.LlamaForCausalLM, tmp_path, model_dir)
    p, d = engine(tiny, 2, kv_lease_ttl_s=1.0), engine(str(tmp_path), 1)
    try:
        ids, _ = expected[0]
        params = prefill(p, "p", ids)
        got = decode(d, "d", ids, params)
        assert len(got) == N and d.connector.stats.fallbacks == {"transfer_failed": 1}
        assert "incompatible" in caplog.text and "total_kv_heads 1 vs 2" in caplog.text
        settle(p, d)
    finally:
        p.close()
        d.close()


def test_replicated_kv_head_pulled_once_other_copy_released(tmp_path, model_dir):
    """1 KV head at TP=2 (replicated on both prefill ranks) -> TP=1: rank 0's copy is
    read, rank 1's released at once (settle waits 10 s, the lease TTL is 30 s)."""
    save_tiny(transformers.LlamaConfig(**(COMMON | dict(num_key_value_heads=1))),
              transformers.LlamaForCausalLM, tmp_path, model_dir)
    ids = prompts_for(1001, (40,))[0]
    c = engine(str(tmp_path), 1, transport=None)
    try:
        c.add_request("c", ids, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
        want = tokens_of(run(c), "c")
    finally:
        c.close()
    p, d = engine(str(tmp_path), 2), engine(str(tmp_path), 1)
    try:
        assert decode(d, "d", ids, prefill(p, "p", ids)) == want
        assert d.connector.stats.failures == 0
        settle(p, d)
    finally:
        p.close()
        d.close()
