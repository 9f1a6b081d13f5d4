"""Prefill engine -> KV pull -> decode engine, in one process over the local transport, on
the real model: the tokens equal colocated generation, and every failure path frees blocks."""

from __future__ import annotations

import os
import time

import pytest
from pydantic import ValidationError

from baton import SamplingParams
from baton.common.internal import KVTransferParams
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore
from baton.engine.errors import InvalidRequestError
from baton.engine.kv_connector import HoldKV, PullKV, PullPrefix
from baton.kv_transfer import installed_transports
from tests.conftest import make_text

pytestmark = pytest.mark.slow

N = 12


def engine(role: str, transport: str = "local", **kw) -> EngineCore:
    cfg = EngineConfig.from_args(dtype="float32", num_kv_blocks=128, kv_transport=transport,
                       engine_id=f"{role}-{time.monotonic_ns()}", **kw)
    return EngineCore(cfg)


@pytest.fixture(scope="module")
def engines():
    p, d, c = engine("prefill"), engine("decode"), EngineCore(EngineConfig.from_args(
        dtype="float32", num_kv_blocks=128))
    yield p, d, c
    p.close()
    d.close()


def run(core: EngineCore, timeout: float = 60.0):
    outs = []
    deadline = time.monotonic() + timeout
    while (core.has_unfinished_requests() or core.needs_polling) and time.monotonic() < deadline:
        outs += core.step()
        time.sleep(0.001)
    return outs


def prefill(p: EngineCore, rid: str, ids: list[int]):
    req = p.make_request(rid, ids, SamplingParams(temperature=0, max_tokens=1), kv=HoldKV())
    p.add(req)
    final = [o for o in run_until_finished(p, rid)][-1]
    assert final.kv_transfer_params is not None
    return final.kv_transfer_params


def run_until_finished(core: EngineCore, rid: str):
    while True:
        for o in core.step():
            if o.request_id == rid:
                yield o
                if o.finished:
                    return


def decode(d: EngineCore, rid: str, ids: list[int], params: KVTransferParams, n: int = N):
    req = d.make_request(rid, ids, SamplingParams(temperature=0, max_tokens=n),
                         kv=PullKV(params))
    outs = d.add(req) + run(d)
    return [t for o in outs if o.request_id == rid for t in o.new_token_ids], outs


def colocated(c: EngineCore, rid: str, ids: list[int], n: int = N) -> list[int]:
    c.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=n))
    return [t for o in run(c) if o.request_id == rid for t in o.new_token_ids]


def assert_no_blocks(*cores: EngineCore) -> None:
    for core in cores:
        deadline = time.monotonic() + 5
        while core.kv.num_used_blocks and time.monotonic() < deadline:
            core.step()
            time.sleep(0.01)
        assert core.kv.num_used_blocks == 0
        core.check_integrity()


@pytest.mark.parametrize("text_len", [1, 3])
def test_pulled_decode_equals_colocated(engines, tokenizer, text_len):
    p, d, c = engines
    ids = tokenizer.encode(make_text(text_len) + "\nSummary:")
    params = prefill(p, f"p{text_len}", ids)
    assert p.kv.num_used_blocks == len(params.block_ids)  # held under the lease
    tokens, outs = decode(d, f"d{text_len}", ids, params)
    assert tokens == colocated(c, f"c{text_len}", ids)
    assert d.connector.stats.transfers >= 1 and d.connector.stats.bytes > 0
    assert_no_blocks(p, d)


@pytest.mark.parametrize("transport", ["tcp", "gloo", "nixl"])
def test_every_network_transport_gives_colocated_tokens(engines, tokenizer, transport):
    if transport not in installed_transports():
        if os.environ.get("BATON_REQUIRE_NIXL") == "1":
            pytest.fail(f"{transport} is not installed but BATON_REQUIRE_NIXL=1")
        pytest.skip(f"the {transport} transport's package is not installed")
    _, _, c = engines
    p, d = engine("prefill", transport), engine("decode", transport)
    try:
        ids = tokenizer.encode(make_text(2, 5) + "\nIn short:")
        tokens, _ = decode(d, "t-d", ids, prefill(p, "t-p", ids))
        assert tokens == colocated(c, f"t-c-{transport}", ids)
        assert d.connector.stats.bytes == len(prefill_blocks(ids)) * d.runner.bytes_per_block
        assert_no_blocks(p, d)
    finally:
        p.close()
        d.close()


def prefill_blocks(ids: list[int]) -> list[int]:
    return list(range(-(-len(ids) // 16)))


def test_decode_prefix_hits_are_not_pulled(engines, tokenizer):
    p, d, c = engines
    ids = tokenizer.encode(make_text(4, 1) + "\nQuestion:")
    first, _ = decode(d, "hit-a", ids, prefill(p, "hit-pa", ids))
    bytes_before = d.connector.stats.bytes
    again, outs = decode(d, "hit-b", ids, prefill(p, "hit-pb", ids))
    assert again == first
    final = [o for o in outs if o.request_id == "hit-b" and o.finished][-1]
    assert final.num_cached_tokens >= 16 * (len(ids) // 16 - 1)
    pulled = d.connector.stats.bytes - bytes_before
    assert pulled < d.runner.bytes_per_block * 2  # only the tail block(s)
    assert_no_blocks(p, d)


def test_expired_lease_recomputes_locally(tokenizer):
    p, d = engine("prefill", kv_lease_ttl_s=0.05), engine("decode")
    try:
        ids = tokenizer.encode(make_text(2, 2))
        params = prefill(p, "x", ids)
        time.sleep(0.2)
        p.step()  # the lease expires: the prefill's blocks are freed
        assert p.kv.num_used_blocks == 0
        tokens, _ = decode(d, "y", ids, params)
        assert d.connector.stats.failures == 1 and d.connector.stats.fallbacks == {"lease_expired": 1}
        ref = EngineCore(EngineConfig.from_args(dtype="float32", num_kv_blocks=128))
        assert tokens == colocated(ref, "z", ids)
        assert_no_blocks(p, d)
    finally:
        p.close()
        d.close()


def test_failed_pull_with_fail_policy_ends_the_request(tokenizer):
    p, d = engine("prefill", kv_lease_ttl_s=0.05), engine("decode", kv_failure_policy="fail")
    try:
        ids = tokenizer.encode(make_text(2, 3))
        params = prefill(p, "x", ids)
        time.sleep(0.2)
        p.step()
        tokens, outs = decode(d, "y", ids, params)
        final = [o for o in outs if o.finished][-1]
        assert final.finish_reason == "abort" and "KV transfer failed" in str(final.stop_reason)
        assert len(tokens) == 1  # only the prefill's first token
        assert_no_blocks(p, d)
    finally:
        p.close()
        d.close()


def test_abort_while_pulling_and_first_token_stop(engines, tokenizer):
    p, d, _ = engines
    ids = tokenizer.encode(make_text(3, 4))
    params = prefill(p, "ab-p", ids)
    req = d.make_request("ab-d", ids, SamplingParams(temperature=0, max_tokens=50),
                         kv=PullKV(params))
    d.add(req)
    d.step()  # admitted: the pull starts
    d.abort_requests(["ab-d"])
    run(d)
    assert_no_blocks(p, d)
    # max_tokens=1: the first token ends it; the holder's lease is released without a pull.
    params = prefill(p, "one-p", ids)
    req = d.make_request("one-d", ids, SamplingParams(temperature=0, max_tokens=1),
                         kv=PullKV(params))
    outs = d.add(req)
    assert outs[-1].finished and outs[-1].new_token_ids == [params.first_token]
    assert_no_blocks(p, d)
    # Aborted while still queued (never admitted): the lease is released at once too.
    params = prefill(p, "queued-p", ids)
    d.add(d.make_request("queued-d", ids, SamplingParams(temperature=0, max_tokens=8),
                         kv=PullKV(params)))
    d.abort_requests(["queued-d"])
    deadline = time.monotonic() + 5
    while p.connector.num_leases_held and time.monotonic() < deadline:
        p.step()
        time.sleep(0.01)
    assert p.connector.num_leases_held == 0  # well before the 30 s lease would expire
    assert_no_blocks(p, d)


def test_bad_transfer_params_are_rejected(engines):
    _, d, c = engines
    with pytest.raises(ValidationError, match="block_ids"):  # malformed: the wire refuses
        KVTransferParams.model_validate({"x": 1})
    good = {"block_ids": [1, 2], "first_token": 5, "lease_id": "l", "num_tokens": 3,
            "lease_ttl_s": 30.0, "endpoint": {
                "transport": "local", "engine_id": "e", "address": "a", "layout": {
                    "num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8,
                    "dtype": "float32"}}}
    with pytest.raises(InvalidRequestError, match="cover"):
        d.make_request("b", [1, 2, 3], SamplingParams(),
                       kv=PullKV(KVTransferParams.model_validate(good)))
    with pytest.raises(InvalidRequestError, match="outside"):
        d.make_request("b", [1, 2, 3], SamplingParams(), kv=PullKV(
            KVTransferParams.model_validate(good | {"block_ids": [1], "first_token": 10**9})))
    with pytest.raises(InvalidRequestError, match="no KV transport"):
        c.make_request("b", [1, 2, 3], SamplingParams(), kv=HoldKV())


def test_seeded_sampling_continues_across_the_handover(engines, tokenizer):
    """A seeded request gives the same tokens colocated and through prefill -> decode: the
    decode pod's sampler skips the draw the prefill pod made for the first token."""
    p, d, c = engines
    ids = tokenizer.encode(make_text(2, 3) + "\nContinue:")
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=N)
    c.add_request("seed-c", ids, params)
    want = [t for o in run(c) if o.request_id == "seed-c" for t in o.new_token_ids]
    pre = p.make_request("seed-p", ids, SamplingParams(temperature=1.0, top_k=50, seed=1234,
                                                       max_tokens=1), kv=HoldKV())
    p.add(pre)
    kv = [o for o in run_until_finished(p, "seed-p")][-1].kv_transfer_params
    req = d.make_request("seed-d", ids, params, kv=PullKV(kv))
    got = [t for o in d.add(req) + run(d) if o.request_id == "seed-d" for t in o.new_token_ids]
    assert got == want
    # A stream resumed after k tokens (prompt + those tokens, k draws made elsewhere).
    k = 5
    c_req = c.make_request("seed-r2", ids + want[:k], SamplingParams(
        temperature=1.0, top_k=50, seed=1234, max_tokens=N - k), presampled=k)
    c.add(c_req)
    outs = run(c)
    resumed = [t for o in outs if o.request_id == "seed-r2" for t in o.new_token_ids]
    assert want[:k] + resumed == want
    assert_no_blocks(p, d, c)


def test_a_prefill_whose_last_token_fails_holds_no_lease(engines, tokenizer, monkeypatch):
    # The request ends once, as an error, before the connector sees it: no lease keeps its
    # blocks until the TTL (the connector used to see "length" and lease them).
    p, _, _ = engines
    ids = tokenizer.encode(make_text(2))

    def broken(req, token):
        raise RuntimeError("the detokenizer broke")

    monkeypatch.setattr(p, "_detok_add", broken)
    p.add(p.make_request("p-broken", ids, SamplingParams(temperature=0, max_tokens=1),
                         kv=HoldKV()))
    final = list(run_until_finished(p, "p-broken"))[-1]
    assert final.finish_reason == "error" and "the detokenizer broke" in final.stop_reason
    assert final.kv_transfer_params is None and final.new_token_ids == []
    assert p.kv.num_used_blocks == 0
    p.check_integrity()


def test_a_speculating_decode_pod_continues_a_pulled_prompt_exactly(engines, tokenizer):
    """Decode pods speculate (`engine.spec`): the pulled prompt's first decodes already
    guess, and the tokens equal colocated generation without speculation."""
    p, _, c = engines
    d = engine("decode", speculative_config='{"method": "ngram", "prompt_lookup_min": 1}')
    try:
        ids = tokenizer.encode(make_text(3, 2) + "\nRepeat the first sentence:")
        tokens, _ = decode(d, "s-d", ids, prefill(p, "s-p", ids), n=40)
        assert tokens == colocated(c, "s-c", ids, n=40)
        assert d.speculator.counters.proposed_tokens > 0
        assert_no_blocks(p, d)
    finally:
        d.close()


# -- a peer's prefix: the earlier turns of a conversation that moved pods ------------------
def lend(holder: EngineCore, rid: str, ids: list[int]) -> KVTransferParams:
    """What a router's peer fetch asks of the pod holding a prompt's prefix: a one-token
    "prefill" of its whole blocks (`ids`), held under a lease."""
    assert len(ids) % 16 == 0
    return prefill(holder, rid, ids)


def pull_prefix(d: EngineCore, rid: str, ids: list[int], params: KVTransferParams,
                n: int = N):
    req = d.make_request(rid, ids, SamplingParams(temperature=0, max_tokens=n),
                         kv=PullPrefix(params))
    outs = d.add(req) + run(d)
    assert not [o for o in outs if o.request_id == rid and o.finish_reason == "abort"]
    return [t for o in outs if o.request_id == rid for t in o.new_token_ids], \
        [o for o in outs if o.request_id == rid and o.finished][-1]


def test_a_peers_prefix_is_pulled_and_only_the_rest_computed(engines, tokenizer):
    p, d, c = engines
    turns = tokenizer.encode("Turn one.\n" + make_text(4, 5) + "\nAnd then:")
    ids = turns + tokenizer.encode(" a second turn that the peer never saw.\nAnswer:")
    held = len(turns) // 16 * 16
    params = lend(p, "peer-p", ids[:held])
    assert params.num_tokens == held and len(params.block_ids) == held // 16
    before = d.connector.stats.bytes
    tokens, final = pull_prefix(d, "peer-d", ids, params)
    assert tokens == colocated(c, "peer-c", ids)  # greedy: exact
    assert d.connector.stats.bytes - before == held // 16 * d.runner.bytes_per_block
    assert final.num_cached_tokens == held  # usage: the peer's tokens count as cached
    assert_no_blocks(p, d)
    # Asked again, the pod holds that prefix itself: nothing is pulled, and the lease is
    # released at once (well before its 30 s TTL), counted as a fallback.
    params = lend(p, "peer-p2", ids[:held])
    before = d.connector.stats.bytes
    tokens, final = pull_prefix(d, "peer-d2", ids, params)
    assert tokens == colocated(c, "peer-c2", ids)
    assert d.connector.stats.bytes == before
    assert d.connector.stats.fallbacks.get("peer_prefix_cached", 0) >= 1
    assert_no_blocks(p, d)


def test_a_prefill_engine_pulls_a_peers_prefix_then_holds_the_whole_prompt(engines,
                                                                            tokenizer):
    """A prefill pod lacking a prefix another pod holds: `HoldKV(peer=...)` pulls it, computes
    the rest, samples the first token and holds the whole prompt for a decode pod."""
    p, d, c = engines
    turns = tokenizer.encode("Earlier turns.\n" + make_text(3, 7) + "\nThen:")
    ids = turns + tokenizer.encode(" the new question for the prefill pod.\nAnswer:")
    held = len(turns) // 16 * 16
    peer = lend(p, "hp-lend", ids[:held])
    before = d.connector.stats.bytes
    req = d.make_request("hp-prefill", ids, SamplingParams(temperature=0, max_tokens=1),
                         kv=HoldKV(peer=peer))
    d.add(req)
    final = list(run_until_finished(d, "hp-prefill"))[-1]
    assert final.kv_transfer_params is not None and final.num_cached_tokens == held
    assert d.connector.stats.bytes - before == held // 16 * d.runner.bytes_per_block
    tokens, _ = decode(p, "hp-decode", ids, final.kv_transfer_params)
    assert tokens == colocated(c, "hp-c", ids)
    assert_no_blocks(p, d)


def test_a_failed_peer_pull_recomputes_even_under_the_fail_policy(engines, tokenizer):
    """A peer's prefix only saves work: its pull failing (the lease expired here) recomputes
    the prompt whatever the P/D failure policy says."""
    _, _, c = engines
    p, d = engine("prefill", kv_lease_ttl_s=0.05), engine("decode", kv_failure_policy="fail")
    try:
        ids = tokenizer.encode(make_text(3, 6) + "\nWhat follows?")
        params = lend(p, "x", ids[:len(ids) // 16 * 16])
        time.sleep(0.2)
        p.step()  # the lease expires
        tokens, final = pull_prefix(d, "y", ids, params)
        assert tokens == colocated(c, "peer-fail-c", ids)
        assert d.connector.stats.fallbacks == {"peer_lease_expired": 1}
        assert final.num_cached_tokens == 0
        assert_no_blocks(p, d)
    finally:
        p.close()
        d.close()


def test_a_peers_prefix_must_be_whole_blocks_short_of_the_prompt(engines):
    _, d, _ = engines
    layout = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8,
              "dtype": "float32"}
    good = {"block_ids": [1, 2], "first_token": 5, "lease_id": "l", "num_tokens": 32,
            "lease_ttl_s": 30.0, "endpoint": {"transport": "local", "engine_id": "e",
                                              "address": "a", "layout": layout}}
    for bad, match in (({"num_tokens": 30}, "whole"), ({"block_ids": [1]}, "blocks"),
                       ({}, "fewer")):
        with pytest.raises(InvalidRequestError, match=match):
            d.make_request("b", list(range(32 if not bad else 40)), SamplingParams(),
                           kv=PullPrefix(KVTransferParams.model_validate(good | bad)))
