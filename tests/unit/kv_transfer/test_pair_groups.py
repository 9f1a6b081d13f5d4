"""gloo (CPU, the stand-in for nccl): one process group per peer pair, built on the first
pull and reused; a restarted holder or puller leads to a new group on both sides and the
old ones torn down, with no groups, stores or threads left behind."""

from __future__ import annotations

import os
import time

import torch

from baton.common.internal import KVEndpointInfo
from baton.kv_transfer import make_transport
from baton.kv_transfer.base import PeerUnreachableError, TransferState
from baton.kv_transfer.network import NetworkTransport
from baton.kv_transfer.pairs import Pair, PairTable
from tests.unit.kv_transfer.factories import cache


def os_threads() -> int:
    """This process's threads, native ones (gloo's, the stores') included."""
    return len(os.listdir("/proc/self/task"))


def settled_threads(seconds: float = 3.0) -> int:
    """The thread count once connection threads have ended (it stops falling)."""
    deadline, last = time.monotonic() + seconds, os_threads()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = os_threads()
        if now == last:
            return now
        last = now
    return last


def _pairs(t: NetworkTransport) -> PairTable:
    """The gloo data plane's pair groups."""
    return t.plane.pairs


def pull(holder: NetworkTransport, puller: NetworkTransport, ep: KVEndpointInfo, rid: str,
         src: list[int], dst: list[int]) -> None:
    lease = holder.hold(rid, src, ttl_s=30)
    t = puller.pull(ep, lease, src, dst, timeout_s=20)
    assert t.wait(20) == TransferState.DONE, t.error
    assert torch.equal(puller.kv_cache[:, :, dst], holder.kv_cache[:, :, src])
    assert holder.released() == [(rid, "pulled")]


def _scenario(rounds: int) -> dict:
    """Pulls over one pair, a holder restart on the same address, a puller restart."""
    holder, puller = make_transport("gloo"), make_transport("gloo")
    ep = holder.start(cache(), "prefill")
    puller.start(cache(fill=False), "decode")
    out = {}
    try:
        for i in range(rounds):
            pull(holder, puller, ep, f"r{i}", [i, i + 1], [15 - i, 14 - i])
        out["one_pair"] = (_pairs(holder).built, len(_pairs(holder)), _pairs(puller).built,
                           len(_pairs(puller)), _pairs(holder).destroyed, _pairs(puller).destroyed)
        old = _pairs(puller).get(ep.address)
        holder.close()  # the holder restarts under the same address
        out["holder_closed"] = (len(_pairs(holder)), _pairs(holder).destroyed)
        holder = make_transport("gloo", port=int(ep.address.rsplit(":", 1)[1]))
        ep = holder.start(cache(), "prefill")
        pull(holder, puller, ep, "after-restart", [3], [4])
        pull(holder, puller, ep, "again", [5], [6])
        out["holder_restart"] = (_pairs(puller).built, _pairs(puller).destroyed, len(_pairs(puller)),
                                 old.group is None and old.store is None,
                                 _pairs(puller).get(ep.address) is not old, _pairs(holder).built)
        puller.close()  # the puller restarts, same engine id
        out["puller_closed"] = (len(_pairs(puller)), _pairs(puller).destroyed)
        puller = make_transport("gloo")
        puller.start(cache(fill=False), "decode")
        pull(holder, puller, ep, "new-puller", [8], [9])
        out["puller_restart"] = (_pairs(holder).built, _pairs(holder).destroyed,
                                 len(_pairs(holder)), _pairs(puller).built)
    finally:
        puller.close()
        holder.close()
    out["closed"] = (len(_pairs(holder)), len(_pairs(puller)))
    return out


def test_one_group_per_pair_reused_and_rebuilt_when_a_peer_restarts():
    _scenario(1)  # gloo's process-wide threads start with the first group ever
    before = settled_threads()
    out = _scenario(5)
    assert out["one_pair"] == (1, 1, 1, 1, 0, 0)  # 5 pulls, one group on each side
    assert out["holder_closed"] == (0, 1)
    # the puller's pull to the restarted holder built a new group and tore the old down
    assert out["holder_restart"] == (2, 1, 1, True, True, 1)
    assert out["puller_closed"] == (0, 2)
    # the holder replaced the dead puller's group with the new puller's
    assert out["puller_restart"] == (2, 1, 1, 1)
    assert out["closed"] == (0, 0)
    assert settled_threads() <= before  # no group, store or connection thread left


def test_two_pullers_have_a_group_each_and_an_unreachable_holder_costs_only_its_own():
    holder = make_transport("gloo")
    ep = holder.start(cache(), "prefill")
    a, b = make_transport("gloo"), make_transport("gloo")
    a.start(cache(fill=False), "decode-a")
    b.start(cache(fill=False), "decode-b")
    try:
        pull(holder, a, ep, "a1", [1], [2])
        pull(holder, b, ep, "b1", [3], [4])
        pull(holder, a, ep, "a2", [5], [6])
        assert (_pairs(holder).built, len(_pairs(holder))) == (2, 2)
        dead = KVEndpointInfo(ep.transport, ep.engine_id, "127.0.0.1:1", ep.layout)
        _pairs(a).put(dead.address, Pair("stale", None, object()))  # as if it had been up
        t = a.pull(dead, "lease", [7], [8], timeout_s=5)  # an unreachable holder ...
        assert t.wait(10) == TransferState.FAILED and isinstance(t.error, PeerUnreachableError)
        assert _pairs(a).get(dead.address) is None and _pairs(a).destroyed == 1  # ... costs it
        pull(holder, b, ep, "b2", [9], [10])
        pull(holder, a, ep, "a3", [11], [12])  # the other groups are untouched, reused
        assert (_pairs(a).built, _pairs(b).built, _pairs(holder).built) == (2, 1, 2)
        assert (len(_pairs(a)), len(_pairs(holder)), _pairs(holder).destroyed) == (1, 2, 0)
    finally:
        a.close()
        b.close()
        holder.close()
