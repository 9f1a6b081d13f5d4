"""tcp's staged data path (what a GPU cache takes), forced on host caches so real bytes go
through it: a bounded buffer smaller than one pull (so every pull is chunked), staged and
zero-copy peers in every combination (the wire is the same), whole caches and head
subsets across TP degrees, and leases that end as with any other pull."""

from __future__ import annotations

import pytest
import torch

from baton.kv_transfer import make_transport
from baton.kv_transfer.base import TransferState, bytes_per_block, head_plan
from baton.kv_transfer.iov import runs
from baton.kv_transfer.network import NetworkTransport
from baton.kv_transfer.staging import StagingPool
from tests.unit.kv_transfer.factories import cache

STAGES = [(True, False), (False, True), (True, True)]  # (holder staged, puller staged)
IDS = ["staged-holder", "staged-puller", "both-staged"]
KVH = 4


@pytest.fixture
def made():
    out: list[NetworkTransport] = []
    yield out
    for t in out:
        t.close()


def _tcp(made: list, staged: bool, **kwargs) -> NetworkTransport:
    t = make_transport("tcp", stage_via_host=staged, staging_bytes=600, **kwargs)
    made.append(t)
    return t


def _staging(t: NetworkTransport) -> StagingPool | None:
    """The staged plane's buffers (None on a zero-copy side)."""
    return getattr(t.plane, "pool", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("stages", STAGES, ids=IDS)
def test_staged_pulls_move_the_same_bytes_in_chunks(made, stages, dtype):
    src_kv, dst_kv = cache(dtype=dtype), cache(dtype=dtype, fill=False)
    holder, puller = _tcp(made, stages[0]), _tcp(made, stages[1])
    ep = holder.start(src_kv, "holder")
    puller.start(dst_kv, "puller")
    src, dst = [7, 2, 3, 4, 15, 9], [0, 5, 6, 7, 11, 1]
    assert 2 * 4 * len(src) * 4 * KVH * 8 * dtype.itemsize > 600  # more than one chunk
    lease = holder.hold("r", src, ttl_s=30)
    t = puller.pull(ep, lease, src, dst, timeout_s=10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert t.bytes == len(src) * bytes_per_block(ep.layout)
    assert torch.equal(dst_kv[:, :, dst].view(torch.uint8), src_kv[:, :, src].view(torch.uint8))
    untouched = [b for b in range(16) if b not in dst]
    assert not dst_kv[:, :, untouched].view(torch.uint8).any()
    assert holder.released() == [("r", "pulled")]
    for t_ in (holder, puller):  # one buffer each, reused; none on a zero-copy side
        assert _staging(t_) is None or _staging(t_).made == 1


def test_many_staged_pulls_reuse_a_bounded_set_of_buffers(made):
    src_kv, dst_kv = cache(blocks=64), cache(blocks=64, fill=False)
    holder, puller = _tcp(made, True), _tcp(made, True)
    ep = holder.start(src_kv, "holder")
    puller.start(dst_kv, "puller")
    transfers = []
    for i in range(16):
        lease = holder.hold(f"r{i}", [4 * i, 4 * i + 1], ttl_s=30)
        transfers.append(puller.pull(ep, lease, [4 * i, 4 * i + 1], [63 - 2 * i, 62 - 2 * i],
                                     timeout_s=10))
    assert all(t.wait(10) == TransferState.DONE for t in transfers)
    for i in range(16):
        assert torch.equal(dst_kv[:, :, [63 - 2 * i, 62 - 2 * i]], src_kv[:, :, [4 * i, 4 * i + 1]])
    assert sorted(holder.released()) == sorted((f"r{i}", "pulled") for i in range(16))
    assert 1 <= _staging(holder).made <= 4 and 1 <= _staging(puller).made <= 4


def _rank(kv: torch.Tensor, rank: int, size: int, name: str, made: list, staged: bool):
    per = KVH // size
    local = kv[:, :, :, :, rank * per:(rank + 1) * per].contiguous()
    t = _tcp(made, staged, heads=(rank * per, KVH, size))
    return t, t.start(local, name), local


@pytest.mark.parametrize("stages", STAGES, ids=IDS)
@pytest.mark.parametrize("n,m", [(1, 2), (2, 1), (4, 2)])
def test_staged_head_subsets_across_tp_degrees(made, stages, n, m):
    whole, target = cache(kvh=KVH), cache(kvh=KVH, fill=False)
    holders = []
    for r in range(n):
        t, ep, _ = _rank(whole, r, n, "prefill", made, stages[0])
        holders.append((t, ep, t.hold("req", [3, 4, 9, 10], ttl_s=30)))
    leases = {ep.address: lease for _, ep, lease in holders}
    for r in range(m):
        puller, _, local = _rank(target, r, m, "decode", made, stages[1])
        for ep, heads, part in head_plan(puller.layout, [ep for _, ep, _ in holders]):
            t = puller.pull(ep, leases[ep.address], [3, 4, 9, 10], [0, 7, 8, 2],
                            timeout_s=10, heads=heads, part=part)
            assert t.wait(10) == TransferState.DONE, t.error
        per = KVH // m
        assert torch.equal(local[:, :, [0, 7, 8, 2]],
                           whole[:, :, [3, 4, 9, 10], :, r * per:(r + 1) * per])
        assert not local[:, :, [1, 5, 6]].any()
    assert all(t.leases.released() == [("req", "pulled")] for t, _, _ in holders)


def test_zero_copy_cannot_be_forced_on_a_device_cache():
    t = make_transport("tcp", stage_via_host=False)
    with pytest.raises(ValueError, match="stage"):
        t.start(torch.empty(4, 2, 16, 4, 2, 8, device="meta"), "holder")
    t.close()


def test_runs_of_consecutive_ids():
    assert runs([3, 4, 5, 9, 2, 3]) == [(3, 3), (9, 1), (2, 2)]
    assert runs([]) == []


def test_a_device_copy_failing_mid_stream_cuts_the_pull_and_keeps_the_lease(made,
                                                                            monkeypatch):
    from baton.kv_transfer.base import PeerUnreachableError
    from baton.kv_transfer.staging import Staging

    src_kv, dst_kv = cache(), cache(fill=False)
    holder, puller = _tcp(made, True), _tcp(made, False)
    ep = holder.start(src_kv, "holder")
    puller.start(dst_kv, "puller")
    real, calls = Staging.gather, []

    def flaky(self, *args):
        calls.append(args)
        if len(calls) == 2:  # after the header and the first chunk
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, *args)
    monkeypatch.setattr(Staging, "gather", flaky)
    lease = holder.hold("r", [1, 2, 3], ttl_s=30)
    t = puller.pull(ep, lease, [1, 2, 3], [4, 5, 6], timeout_s=10)
    assert t.wait(10) == TransferState.FAILED and isinstance(t.error, PeerUnreachableError)
    assert holder.released() == []  # held for its puller's retry
    monkeypatch.setattr(Staging, "gather", real)
    t = puller.pull(ep, lease, [1, 2, 3], [4, 5, 6], timeout_s=10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, [4, 5, 6]], src_kv[:, :, [1, 2, 3]])
    assert holder.released() == [("r", "pulled")] and _staging(holder).made == 1
