"""One conformance suite for every KV transport installed (docs/design.md §5)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
import torch
from pydantic import TypeAdapter

from baton.common.internal import KVEndpointInfo
from baton.kv_transfer import make_transport
from baton.kv_transfer.base import (
    KVAuthError,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerUnreachableError,
    TransferError,
    TransferState,
    TransferTimeoutError,
    bytes_per_block,
)
from baton.kv_transfer.messages import PullRequest
from tests.unit.kv_transfer.factories import OTHER_SECRET, SECRET, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remapped_blocks_all_layers(make, dtype):
    src_kv, dst_kv = cache(layers=12, dtype=dtype), cache(layers=12, dtype=dtype, fill=False)
    holder, ep = make(src_kv)
    puller, _ = make(dst_kv)
    src, dst = [7, 2, 9, 15], [0, 5, 3, 11]
    lease = holder.hold("r1", src, ttl_s=30)
    puller.connect(ep)
    puller.connect(ep)  # idempotent
    t = puller.pull(ep, lease, src, dst, timeout_s=10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, dst], src_kv[:, :, src])
    untouched = [b for b in range(16) if b not in dst]
    assert not dst_kv[:, :, untouched].any()
    assert holder.released() == [("r1", "pulled")]
    assert holder.released() == []  # exactly once


def test_runs_of_consecutive_blocks_differ_on_each_side(make):
    src_kv, dst_kv = cache(), cache(fill=False)
    holder, ep = make(src_kv)
    puller, _ = make(dst_kv)
    src, dst = [3, 4, 5, 6, 9, 10], [12, 13, 1, 2, 3, 7]
    lease = holder.hold("r", src, 30)
    t = puller.pull(ep, lease, src, dst, timeout_s=10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, dst], src_kv[:, :, src])
    assert t.bytes == len(src) * bytes_per_block(ep.layout)


def test_two_concurrent_peers(make):
    a_kv, b_kv, dst_kv = cache(), cache(), cache(fill=False)
    a, ep_a = make(a_kv)
    b, ep_b = make(b_kv)
    puller, _ = make(dst_kv)
    la = a.hold("ra", [1, 2, 3], 30)
    lb = b.hold("rb", [4, 5, 6], 30)
    ta = puller.pull(ep_a, la, [1, 2, 3], [0, 1, 2], 10)
    tb = puller.pull(ep_b, lb, [4, 5, 6], [3, 4, 5], 10)
    assert ta.wait(10) == tb.wait(10) == TransferState.DONE
    assert torch.equal(dst_kv[:, :, :3], a_kv[:, :, [1, 2, 3]])
    assert torch.equal(dst_kv[:, :, 3:6], b_kv[:, :, [4, 5, 6]])
    assert a.released() == [("ra", "pulled")] and b.released() == [("rb", "pulled")]


def test_empty_transfer(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    lease = holder.hold("r0", [], 30)
    t = puller.pull(ep, lease, [], [], 10)
    assert t.wait(10) == TransferState.DONE and t.bytes == 0
    assert holder.released() == [("r0", "pulled")]


def test_layout_mismatch_rejected(make):
    holder, ep = make(cache(d=8))
    puller, _ = make(cache(d=16, fill=False))
    lease = holder.hold("r", [1], 30)
    with pytest.raises(LayoutMismatchError):
        puller.connect(ep)
    t = puller.pull(ep, lease, [1], [1], 10)
    assert t.wait(10) == TransferState.FAILED
    assert isinstance(t.error, LayoutMismatchError)
    bf16, _ = make(cache(dtype=torch.bfloat16, fill=False))
    with pytest.raises(LayoutMismatchError):
        bf16.connect(ep)


def test_lease_expiry_frees_and_later_pull_fails(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    lease = holder.hold("r", [1, 2], ttl_s=0.2)
    time.sleep(0.3)
    assert holder.released() == [("r", "expired")]
    t = puller.pull(ep, lease, [1, 2], [1, 2], 10)
    assert t.wait(10) == TransferState.FAILED
    assert isinstance(t.error, LeaseExpiredError)
    assert holder.released() == []


def test_unknown_blocks_and_bad_destinations(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    lease = holder.hold("r", [1, 2], 30)
    t = puller.pull(ep, lease, [1, 3], [1, 2], 10)  # block 3 is not under the lease
    assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)
    t = puller.pull(ep, lease, [1, 10**6], [1, 2], 10)  # outside the holder's cache
    assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)
    with pytest.raises(ValueError):
        puller.pull(ep, lease, [1, 2], [1], 10)
    with pytest.raises(ValueError):
        puller.pull(ep, lease, [1, 2], [1, 99], 10)
    with pytest.raises(ValueError):
        puller.pull(ep, lease, [1, 1], [1, 2], 10)  # a block twice
    with pytest.raises(ValueError):
        holder.hold("r-bad", [1, 16], 30)  # the holder's cache has 16 blocks
    # The failed attempts left the lease held: a correct retry still succeeds, once.
    t = puller.pull(ep, lease, [1, 2], [4, 5], 10)
    assert t.wait(10) == TransferState.DONE
    assert holder.released() == [("r", "pulled")]


# -- who may pull: secrets and leases --------------------------------------------------------
def test_matching_secrets_pull(make):
    src_kv, dst_kv = cache(), cache(fill=False)
    holder, ep = make(src_kv, secret=SECRET)
    puller, _ = make(dst_kv, secret=SECRET)
    lease = holder.hold("r", [3, 4], 30)
    puller.connect(ep)
    t = puller.pull(ep, lease, [3, 4], [0, 1], 10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, [0, 1]], src_kv[:, :, [3, 4]])
    assert holder.released() == [("r", "pulled")]


@pytest.mark.parametrize("holder_secret,puller_secret", [
    (SECRET, OTHER_SECRET), (SECRET, None), (None, SECRET)],
    ids=["wrong-secret", "puller-without", "holder-without"])
def test_a_peer_without_the_same_secret_is_refused(make, holder_secret, puller_secret):
    src_kv, dst_kv = cache(), cache(fill=False)
    holder, ep = make(src_kv, secret=holder_secret)
    stranger, _ = make(dst_kv, secret=puller_secret)
    lease = holder.hold("r", [1, 2], 30)
    with pytest.raises(KVAuthError):
        stranger.connect(ep)
    for src, dst in (([1, 2], [1, 2]), ([], [])):  # neither read nor release it
        t = stranger.pull(ep, lease, src, dst, 10)
        assert t.wait(10) == TransferState.FAILED and isinstance(t.error, KVAuthError), t.error
    assert not dst_kv.any() and holder.released() == []
    friend, _ = make(dst_kv, secret=holder_secret)  # the lease is intact for a real peer
    t = friend.pull(ep, lease, [1, 2], [1, 2], 10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert holder.released() == [("r", "pulled")]


def test_lease_ids_are_random_never_the_request_id(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    ids = [holder.hold(f"client-request-{i}", [i], 30) for i in range(8)]
    assert len(set(ids)) == 8
    assert all(len(lid) >= 22 and "client-request" not in lid for lid in ids)  # >= 128 bits
    near = ids[1][:-1] + ("A" if ids[1][-1] != "A" else "B")  # one character off
    for guess in ("client-request-1", secrets.token_urlsafe(24), near):
        t = puller.pull(ep, guess, [1], [1], 10)
        assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)
    assert holder.released() == []
    t = puller.pull(ep, ids[1], [1], [1], 10)
    assert t.wait(10) == TransferState.DONE, t.error


def test_a_pulled_lease_cannot_be_replayed(make):
    holder, ep = make(cache())
    a, _ = make(cache(fill=False))
    b, _ = make(cache(fill=False))
    lease = holder.hold("r", [5], 30)
    assert a.pull(ep, lease, [5], [0], 10).wait(10) == TransferState.DONE
    for puller in (b, a):
        t = puller.pull(ep, lease, [5], [0], 10)
        assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)
    assert holder.released() == [("r", "pulled")]


def test_the_holder_ends_a_lease_nobody_will_pull(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    lease = holder.hold("r", [1], 30)
    assert holder.release(lease) and not holder.release(lease)
    assert holder.released() == [("r", "released")]
    t = puller.pull(ep, lease, [1], [1], 10)
    assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)


def test_a_lease_is_bound_to_the_puller_that_claimed_it(make, kind):
    """A claims the lease and vanishes mid-pull: the lease stays held for A's retry, and
    B, presenting the same id, can neither read nor release it."""
    if kind in ("local", "gloo"):
        pytest.skip("needs a pull that claims a lease and dies: the tcp control plane's "
                    "(gloo's holder waits out its group's 30 s setup before it lets go)")
    src_kv, dst_kv = cache(), cache(fill=False)
    holder, ep = make(src_kv)
    a, _ = make(dst_kv)
    b, _ = make(cache(fill=False))
    lease = holder.hold("r", [6, 7], 30)
    with a.puller.open(ep, 5) as sock:  # the request and the holder's header, then gone
        a.puller.request(sock, ep, PullRequest(op="pull", lease=lease, src=[6, 7]),
                   time.monotonic() + 5)
    deadline = time.monotonic() + 5
    while True:
        for src, dst in (([6, 7], [0, 1]), ([], [])):
            t = b.pull(ep, lease, src, dst, 10)
            assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)
        if "another puller" in str(t.error) or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # the holder has not noticed A is gone yet
    assert "claimed by another puller" in str(t.error)
    t = a.pull(ep, lease, [6, 7], [2, 3], 10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, [2, 3]], src_kv[:, :, [6, 7]])
    assert holder.released() == [("r", "pulled")]


HOLDER = """
import json, sys, time, torch
from pydantic_core import to_jsonable_python
from baton.kv_transfer import make_transport
kv = torch.ones(8, 2, 512, 16, 8, 64, dtype=torch.float32)  # 1 GiB
t = make_transport(sys.argv[1])
ep = t.start(kv, "victim")
lease = t.hold("big", list(range(512)), 60)
print(json.dumps({"endpoint": to_jsonable_python(ep), "lease": lease}), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_peer_lost_mid_transfer_is_a_typed_error_in_time(how, kind):
    if kind == "local":
        pytest.skip("the holder is another process only for network transports")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, kind], stdout=subprocess.PIPE)
    try:
        started = json.loads(proc.stdout.readline())
        ep = TypeAdapter(KVEndpointInfo).validate_python(started["endpoint"])
        puller = make_transport(kind)
        puller.start(torch.zeros(8, 2, 512, 16, 8, 64), "puller")
        t0 = time.monotonic()
        t = puller.pull(ep, started["lease"], list(range(512)), list(range(512)),
                        timeout_s=3.0)
        deadline = time.monotonic() + 5
        while t.poll() == TransferState.PENDING and time.monotonic() < deadline:
            time.sleep(0.0005)
        # Connected and transferring: 1 GiB takes far longer than this gap to move.
        os.kill(proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        state = t.wait(10)
        elapsed = time.monotonic() - t0
        assert state == TransferState.FAILED and elapsed < 4.5
        expected = PeerUnreachableError if how == "kill" else TransferTimeoutError
        assert isinstance(t.error, expected), repr(t.error)
        assert isinstance(t.error, TransferError)
        puller.close()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
