"""KV transfer between engines of different tensor-parallel degrees over tcp: each rank's
layout names its global KV heads, `head_plan` splits a puller rank's heads over the holder's
ranks, and a pull moves exactly those heads of each block (strided views, no copy)."""

from __future__ import annotations

import pytest
import torch
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer import make_transport
from baton.kv_transfer.base import LayoutMismatchError, TransferState, head_plan
from baton.kv_transfer.network import NetworkTransport
from tests.unit.kv_transfer.factories import cache

KVH = 4


def _rank(kv: torch.Tensor, rank: int, size: int, name: str):
    """A tcp transport serving rank `rank` of `size`'s slice of the whole cache `kv`."""
    per = KVH // size
    local = kv[:, :, :, :, rank * per:(rank + 1) * per].contiguous()
    t = make_transport("tcp", heads=(rank * per, KVH, size))
    return t, t.start(local, name), local  # an engine's ranks share its id


@pytest.fixture
def made():
    out = []
    yield out
    for t in out:
        t.close()


def _pull_all(puller: NetworkTransport,
              holders: list[tuple[NetworkTransport, KVEndpointInfo, str]],
              src: list[int], dst: list[int]) -> None:
    plan = head_plan(puller.layout, [ep for _, ep, _ in holders])
    leases = {ep.address: lease for _, ep, lease in holders}
    for ep, heads, part in plan:
        puller.connect(ep)
        t = puller.pull(ep, leases[ep.address], src, dst, timeout_s=10, heads=heads,
                        part=part)
        assert t.wait(10) == TransferState.DONE, t.error


@pytest.mark.parametrize("n,m", [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2)])
def test_prefill_tp_n_to_decode_tp_m(made, n, m):
    whole = cache(kvh=KVH)
    holders = []
    for r in range(n):
        t, ep, _ = _rank(whole, r, n, "prefill")
        made.append(t)
        holders.append((t, ep, t.hold("req", [3, 4, 9], ttl_s=30)))
    target = cache(kvh=KVH, fill=False)
    for r in range(m):
        t, _, local = _rank(target, r, m, "decode")
        made.append(t)
        _pull_all(t, holders, [3, 4, 9], [0, 7, 8])
        per = KVH // m
        assert torch.equal(local[:, :, [0, 7, 8]],
                           whole[:, :, [3, 4, 9], :, r * per:(r + 1) * per])
        assert not local[:, :, [1, 2]].any()  # nothing else written
    # every holder rank's lease ended once each decode rank reading it had its part
    assert all(len(t.leases) == 0 for t, _, _ in holders)
    assert all(t.leases.released() == [("req", "pulled")] for t, _, _ in holders)


def test_incompatible_layouts_refused_at_connect_with_the_reason(made):
    holder, ep, _ = _rank(cache(kvh=KVH), 0, 1, "prefill")
    made.append(holder)
    for other, why in ((cache(kvh=2), "total_kv_heads 2 vs 4"),
                       (cache(kvh=KVH, d=16), "head_dim 16 vs 8"),
                       (cache(kvh=KVH, layers=2), "num_layers 2 vs 4"),
                       (cache(kvh=KVH, bs=8), "block_size 8 vs 4"),
                       (cache(kvh=KVH, dtype=torch.bfloat16), "bfloat16 vs float32")):
        puller = make_transport("tcp")
        made.append(puller)
        puller.start(other, "decode")
        with pytest.raises(LayoutMismatchError, match=why):
            puller.connect(ep)
        with pytest.raises(LayoutMismatchError, match=why):
            head_plan(puller.layout, [ep])


def test_heads_no_holder_rank_has_are_refused():
    mine = KVLayoutInfo(4, 4, 2, 8, "float32", total_kv_heads=4, head_start=2, tp_size=2)
    only_first = KVEndpointInfo("tcp", "p", "h:1", KVLayoutInfo(4, 4, 2, 8, "float32", 4, 0, 2))
    with pytest.raises(LayoutMismatchError, match=r"heads \[2, 4\) of ours are held by no"):
        head_plan(mine, [only_first])


def test_a_whole_cache_keeps_its_tp1_wire_and_fingerprint():
    lay = KVLayoutInfo.of(cache(kvh=KVH))
    assert to_jsonable_python(lay) == {"num_layers": 4, "block_size": 4, "num_kv_heads": KVH,
                             "head_dim": 8, "dtype": "float32"}
    shard = KVLayoutInfo.of(cache(kvh=2), head_start=2, total_kv_heads=KVH, tp_size=2)
    assert shard.fingerprint == lay.fingerprint  # same blocks, another TP degree
    ep = KVEndpointInfo("tcp", "e", "127.0.0.1:1", shard)
    wire = TypeAdapter(KVEndpointInfo)  # the endpoint as it travels, there and back
    assert wire.validate_json(wire.dump_json(ep)) == ep
    with pytest.raises(ValueError, match="outside the model"):
        KVLayoutInfo(4, 4, 2, 8, "float32", total_kv_heads=4, head_start=3)


def test_a_holder_refuses_heads_it_does_not_hold(made):
    holder, ep, _ = _rank(cache(kvh=KVH), 1, 2, "prefill")  # heads [2, 4)
    puller, _, _ = _rank(cache(kvh=KVH, fill=False), 0, 2, "decode")  # heads [0, 2)
    made += [holder, puller]
    with pytest.raises(LayoutMismatchError, match="none of ours"):
        puller.connect(ep)
    lease = holder.hold("r", [1], ttl_s=30)
    t = puller.pull(ep, lease, [1], [1], timeout_s=5)
    assert t.wait(5) == TransferState.FAILED and isinstance(t.error, LayoutMismatchError)


def test_replicated_heads_are_read_from_one_rank_and_the_other_copy_released(made):
    """1 KV head at TP=2: both holder ranks hold it; a TP=1 puller reads rank 0's and
    releases rank 1's copy with an empty pull."""
    from baton.kv_transfer.base import unread_peers

    whole = cache(kvh=1)
    holders = []
    for _ in range(2):
        t = make_transport("tcp", heads=(0, 1, 2))
        ep = t.start(whole.clone(), "prefill")
        made.append(t)
        holders.append((t, ep, t.hold("req", [2], ttl_s=30)))
    puller = make_transport("tcp")
    target = cache(kvh=1, fill=False)
    puller.start(target, "decode")
    made.append(puller)
    eps = [ep for _, ep, _ in holders]
    assert [p for p, _, _ in head_plan(puller.layout, eps)] == [eps[0]]
    assert unread_peers(puller.layout, eps) == [eps[1]]
    _pull_all(puller, holders[:1], [2], [5])
    t = puller.pull(eps[1], holders[1][2], [], [], timeout_s=5)
    assert t.wait(5) == TransferState.DONE
    assert torch.equal(target[:, :, 5], whole[:, :, 2])
    assert all(len(h.leases) == 0 for h, _, _ in holders)


def test_tp1_transfer_params_keep_the_wire_of_before():
    import json

    from baton.common.internal import KVTransferParams

    whole = KVEndpointInfo("tcp", "e", "127.0.0.1:1", KVLayoutInfo.of(cache(kvh=KVH)))
    params = KVTransferParams(endpoint=whole,
                              block_ids=[1], num_tokens=3, lease_id="x", first_token=5,
                              lease_ttl_s=30)
    wire = json.loads(params.model_dump_json())
    assert "rank_endpoints" not in wire
    assert set(wire["endpoint"]["layout"]) == {"num_layers", "block_size", "num_kv_heads",
                                               "head_dim", "dtype"}
    shard = KVEndpointInfo("tcp", "e", "127.0.0.1:2", KVLayoutInfo.of(cache(kvh=2), 2, KVH, 2))
    infos = [whole, shard]
    tp = KVTransferParams.model_validate_json(params.model_copy(
        update={"rank_endpoints": infos}).model_dump_json())
    assert tp.rank_endpoints[1] == shard
