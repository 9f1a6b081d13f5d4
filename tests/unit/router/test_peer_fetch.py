"""Peer fetch's routing half (`router.peer_fetch`): which pod lends a prompt's prefix, when a
pull is worth it, how the prefix scorer values a peer's blocks, and the holder's answer
checked before a decode pod is sent to pull it. The pull itself runs in
tests/unit/engine/test_disagg.py and, through real processes, in
tests/integration/test_registry_routing.py."""

from __future__ import annotations

import pytest

from baton.common.internal import KVTransferParams
from baton.common.registry import DEVICE, HOST, member
from baton.common.roles import Role
from baton.router import peer_fetch
from baton.router.discovery import Discovery, Upstream
from baton.router.prefix import (
    BLOCK_PREFILL_S,
    PEER_BLOCK_S,
    PEER_FETCH_S,
    TIER_WEIGHTS,
    BlockIndex,
    peer_fetch_value,
)
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.disagg import DisaggSettings
from baton.router.scheduling.scorers import prefix

HASHES = [f"{i:x}" for i in range(1, 65)]  # a 64-block prompt (1,024 tokens)
IDS = tuple(range(64 * 16 + 5))


def pod(name: str, role: str = Role.DECODE, held: int = 0, index: BlockIndex | None = None,
        tier: str = DEVICE, **kw) -> Upstream:
    up = Upstream(f"http://{name}", role=role, model="m", healthy=True, worker_id=name, **kw)
    if index is not None:
        index.held[name] = {member(h, tier) for h in HASHES[:held]}
    return up


def context(index: BlockIndex, **kw) -> RoutingContext:
    return RoutingContext(model="m", prefix_hashes=HASHES, prefix_index=index,
                          block_tokens=16, prompt_tokens=len(IDS), prompt_token_ids=IDS, **kw)


def test_the_longest_holder_lends_when_the_pull_saves_enough():
    index = BlockIndex()
    picked = pod("d0", held=4, index=index)
    pods = [picked, pod("d1", held=40, index=index), pod("p0", Role.PREFILL, 60, index),
            pod("gone", held=64, index=index, open_until=1e18)]  # its circuit is open
    ctx, settings = context(index), DisaggSettings()
    assert peer_fetch.enabled(ctx, settings)
    assert peer_fetch.holder(pods, picked, ctx, settings) == (pods[2], 60 * 16)
    # Of equal holders, the least busy lends.
    index.held["d1"] = set(index.held["p0"])
    pods[2].running = 3
    assert peer_fetch.holder(pods, picked, ctx, settings) == (pods[1], 60 * 16)
    # Not worth it: fewer tokens than peer_fetch_min_tokens to gain, or off.
    assert peer_fetch.holder(pods, picked, ctx, DisaggSettings(peer_fetch_min_tokens=2000)) \
        is None
    assert not peer_fetch.enabled(ctx, DisaggSettings(peer_fetch=False))
    # The approximate index, or a request the router has no token ids for: never.
    assert not peer_fetch.enabled(RoutingContext(model="m", prefix_hashes=HASHES,
                                                 prefix_index=index), settings)
    from baton.router.prefix import ApproximatePrefixIndex

    assert not peer_fetch.enabled(context(ApproximatePrefixIndex()), settings)


def test_a_whole_prompt_held_leaves_its_last_token_to_compute():
    index = BlockIndex()
    picked, other = pod("d0", index=index), pod("d1", held=64, index=index)
    ids = tuple(range(64 * 16))  # exactly 64 blocks: the lend stops one block short
    ctx = RoutingContext(model="m", prefix_hashes=HASHES, prefix_index=index,
                         block_tokens=16, prompt_tokens=len(ids), prompt_token_ids=ids)
    assert peer_fetch.holder([picked, other], picked, ctx, DisaggSettings()) == \
        (other, 63 * 16)


def test_the_scorer_ranks_device_over_host_over_a_peer_over_nothing():
    index = BlockIndex()
    pods = [pod("dev", held=40, index=index), pod("host", held=40, index=index, tier=HOST),
            pod("none", index=index)]
    ctx = context(index, peer_fetch_min_tokens=256)
    dev, host, none = prefix(pods, ctx)
    assert dev > host > none > 0  # "none" would pull the 40 blocks the others hold
    assert prefix(pods, context(index))[2] == 0  # without peer fetch it is worth nothing
    # A peer's block is worth less than any tier's, and a short pull nothing.
    assert peer_fetch_value(40, 16, 256) < 40 * min(TIER_WEIGHTS.values())
    assert peer_fetch_value(8, 16, 256) == 0.0
    assert peer_fetch_value(40, 16, 256) == pytest.approx(
        (40 * (BLOCK_PREFILL_S - PEER_BLOCK_S) - PEER_FETCH_S) / BLOCK_PREFILL_S)


def test_a_lend_is_checked_before_a_decode_pod_pulls_it():
    layout = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8,
              "dtype": "float32"}
    params = KVTransferParams.model_validate({
        "block_ids": [3, 4], "first_token": 5, "lease_id": "l", "num_tokens": 32,
        "lease_ttl_s": 30.0, "endpoint": {"transport": "tcp", "engine_id": "e",
                                          "address": "a:1", "layout": layout}})
    prefix32 = list(range(32))
    assert peer_fetch.lent_problem(params, prefix32, prefix32, 16) is None
    assert "other tokens" in peer_fetch.lent_problem(params, [0] * 32, prefix32, 16)
    short = params.model_copy(update={"block_ids": [3]})
    assert "blocks" in peer_fetch.lent_problem(short, prefix32, prefix32, 16)
    body = peer_fetch.lend_request(type("R", (), {"model": "adapter-a"})(), prefix32)
    assert body.api == "completions" and body.request.model == "adapter-a"
    assert body.request.prompt == prefix32 and body.request.max_tokens == 1


def test_a_generate_request_carries_a_peer_prefix_shorter_than_its_prompt():
    from pydantic import ValidationError

    from baton.common.internal import GenerateRequest

    layout = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8,
              "dtype": "float32"}
    lease = {"block_ids": [3, 4], "first_token": 0, "lease_id": "l", "num_tokens": 32,
             "lease_ttl_s": 30.0, "endpoint": {"transport": "tcp", "engine_id": "e",
                                               "address": "a:1", "layout": layout}}
    base = {"api": "completions", "request": {"model": "m", "prompt": "hi"},
            "peer_prefix": lease}
    ok = GenerateRequest.model_validate(base | {"prompt_token_ids": list(range(40))})
    assert GenerateRequest.model_validate_json(ok.to_json()).peer_prefix == ok.peer_prefix
    for bad in ({}, {"prompt_token_ids": list(range(32))},
                {"prompt_token_ids": list(range(40)), "kv_transfer_params": lease}):
        with pytest.raises(ValidationError, match="peer_prefix"):
            GenerateRequest.model_validate(base | bad)


class Pods(Discovery):
    """Upstreams as given (no health checks)."""

    def __init__(self, upstreams: list[Upstream]) -> None:
        self.endpoints = {u.url: u for u in upstreams}

    async def start(self, session) -> None:
        pass

    async def stop(self) -> None:
        pass


def lease_for(n: int) -> KVTransferParams:
    layout = {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8,
              "dtype": "float32"}
    return KVTransferParams.model_validate({
        "block_ids": list(range(n // 16)), "first_token": 0, "lease_id": f"lease-{n}",
        "num_tokens": n, "lease_ttl_s": 30.0, "endpoint": {
            "transport": "tcp", "engine_id": "e", "address": "a:1", "layout": layout}})


@pytest.mark.parametrize("prefill_ok", [True, False])
def test_a_prefill_pod_is_lent_the_prefix_and_a_failed_prefill_leaves_it_to_decode(prefill_ok):
    """The P/D decider sends the prompt to a prefill pod holding none of it while a decode
    pod holds 40 blocks: that pod lends them to the prefill pod (its PrefillRequest carries
    them); if the prefill fails, the decode pod picked pulls the lent prefix itself."""
    import asyncio

    from baton.common.internal import PrefillResponse
    from baton.common.metrics import RouterMetrics
    from baton.common.protocol import CompletionRequest
    from baton.router.remote_prefill import RemotePrefill
    from baton.router.scheduling.pipeline import RoutingPipeline
    from baton.router.settings import ProxySettings, Tunables

    index = BlockIndex()
    picked, holder = pod("d0", index=index), pod("d1", held=40, index=index, running=9)
    prefill = pod("p0", Role.PREFILL, index=index)
    remote = RemotePrefill(None, Pods([picked, holder, prefill]), RouterMetrics())
    calls: list = []
    answer = PrefillResponse(prompt_token_ids=list(IDS), prefill_s=0.1,
                             kv_transfer_params=lease_for(len(IDS) - 5).model_copy(
                                 update={"num_tokens": len(IDS), "lease_id": "whole"}))

    async def call(up, message, request_id, ctx, tunables, span, peer=False):
        calls.append((up.url, peer, message))
        if peer:
            prompt = message.request.prompt
            return PrefillResponse(prompt_token_ids=prompt, prefill_s=0.0,
                                   kv_transfer_params=lease_for(len(prompt)))
        return answer if prefill_ok else None

    remote._call = call
    tunables = Tunables(RoutingPipeline(scorers={"queue": 1.0}), ProxySettings(),
                        DisaggSettings(min_prefill_tokens=64))
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 4})
    plan = asyncio.run(remote.plan("completions", req, "r1", context(index), tunables))
    lent = lease_for(40 * 16)
    assert [(u, peer) for u, peer, _ in calls] == [(holder.url, True), (prefill.url, False)]
    assert calls[0][2].request.prompt == list(IDS[:40 * 16])
    assert calls[1][2].peer_prefix == lent and calls[1][2].prompt_token_ids == list(IDS)
    assert plan.preferred is picked
    if prefill_ok:
        assert plan.kv_transfer_params == answer.kv_transfer_params and plan.peer_prefix is None
        assert plan.handover.holder is prefill
    else:
        assert plan.kv_transfer_params is None and plan.peer_prefix == lent
        assert plan.prompt_token_ids == list(IDS) and plan.handover.holder is holder
