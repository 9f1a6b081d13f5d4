"""One conformance suite for every KV transport installed (docs/design.md §5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from baton.kv_transfer import TRANSPORTS, installed_transports, make_transport
from baton.kv_transfer.base import (Endpoint, LayoutMismatchError, LeaseExpiredError,
                                    PeerUnreachableError, TransferError,
                                    TransferState, TransferTimeoutError)


def cache(layers=4, blocks=16, bs=4, kvh=2, d=8, dtype=torch.float32, fill=True):
    if fill:
        return torch.randn(layers, 2, blocks, bs, kvh, d).to(dtype)
    return torch.zeros(layers, 2, blocks, bs, kvh, d, dtype=dtype)


@pytest.fixture(params=TRANSPORTS)
def kind(request):
    if request.param not in installed_transports():
        if os.environ.get("BATON_REQUIRE_NIXL") == "1":
            pytest.fail(f"{request.param} is not installed but BATON_REQUIRE_NIXL=1")
        pytest.skip(f"the {request.param} transport's package is not installed")
    return request.param


@pytest.fixture
def make(kind):
    made = []

    def _make(kv, name=None):
        t = make_transport(kind)
        ep = t.start(kv, name or f"engine-{uuid.uuid4().hex[:8]}")
        made.append(t)
        return t, ep

    yield _make
    for t in made:
        t.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remapped_blocks_all_layers(make, dtype):
    src_kv, dst_kv = cache(layers=12, dtype=dtype), cache(layers=12, dtype=dtype, fill=False)
    holder, ep = make(src_kv)
    puller, _ = make(dst_kv)
    src, dst = [7, 2, 9, 15], [0, 5, 3, 11]
    holder.hold("r1", src, ttl_s=30)
    puller.connect(ep)
    puller.connect(ep)  # idempotent
    t = puller.pull(ep, "r1", src, dst, timeout_s=10)
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
    holder.hold("r", src, 30)
    t = puller.pull(ep, "r", src, dst, timeout_s=10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, dst], src_kv[:, :, src])
    assert t.bytes == len(src) * ep.layout.bytes_per_block


def test_two_concurrent_peers(make):
    a_kv, b_kv, dst_kv = cache(), cache(), cache(fill=False)
    a, ep_a = make(a_kv)
    b, ep_b = make(b_kv)
    puller, _ = make(dst_kv)
    a.hold("ra", [1, 2, 3], 30)
    b.hold("rb", [4, 5, 6], 30)
    ta = puller.pull(ep_a, "ra", [1, 2, 3], [0, 1, 2], 10)
    tb = puller.pull(ep_b, "rb", [4, 5, 6], [3, 4, 5], 10)
    assert ta.wait(10) == tb.wait(10) == TransferState.DONE
    assert torch.equal(dst_kv[:, :, :3], a_kv[:, :, [1, 2, 3]])
    assert torch.equal(dst_kv[:, :, 3:6], b_kv[:, :, [4, 5, 6]])
    assert a.released() == [("ra", "pulled")] and b.released() == [("rb", "pulled")]


def test_empty_transfer(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    holder.hold("r0", [], 30)
    t = puller.pull(ep, "r0", [], [], 10)
    assert t.wait(10) == TransferState.DONE and t.bytes == 0
    assert holder.released() == [("r0", "pulled")]


def test_layout_mismatch_rejected(make):
    holder, ep = make(cache(d=8))
    puller, _ = make(cache(d=16, fill=False))
    holder.hold("r", [1], 30)
    with pytest.raises(LayoutMismatchError):
        puller.connect(ep)
    t = puller.pull(ep, "r", [1], [1], 10)
    assert t.wait(10) == TransferState.FAILED
    assert isinstance(t.error, LayoutMismatchError)
    bf16, _ = make(cache(dtype=torch.bfloat16, fill=False))
    with pytest.raises(LayoutMismatchError):
        bf16.connect(ep)


def test_lease_expiry_frees_and_later_pull_fails(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    holder.hold("r", [1, 2], ttl_s=0.2)
    time.sleep(0.3)
    assert holder.released() == [("r", "expired")]
    t = puller.pull(ep, "r", [1, 2], [1, 2], 10)
    assert t.wait(10) == TransferState.FAILED
    assert isinstance(t.error, LeaseExpiredError)
    assert holder.released() == []


def test_unknown_blocks_and_bad_destinations(make):
    holder, ep = make(cache())
    puller, _ = make(cache(fill=False))
    holder.hold("r", [1, 2], 30)
    t = puller.pull(ep, "r", [1, 3], [1, 2], 10)  # block 3 is not under the lease
    assert t.wait(10) == TransferState.FAILED and isinstance(t.error, LeaseExpiredError)
    with pytest.raises(ValueError):
        puller.pull(ep, "r", [1, 2], [1], 10)
    with pytest.raises(ValueError):
        puller.pull(ep, "r", [1, 2], [1, 99], 10)
    # The failed attempt left the lease held: a correct retry still succeeds, once.
    t = puller.pull(ep, "r", [1, 2], [4, 5], 10)
    assert t.wait(10) == TransferState.DONE
    assert holder.released() == [("r", "pulled")]


HOLDER = """
import json, sys, time, torch
from baton.kv_transfer import make_transport
kv = torch.ones(8, 2, 512, 16, 8, 64, dtype=torch.float32)  # 1 GiB
t = make_transport(sys.argv[1])
ep = t.start(kv, "victim")
t.hold("big", list(range(512)), 60)
print(json.dumps(ep.to_dict()), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_peer_lost_mid_transfer_is_a_typed_error_in_time(how, kind):
    if kind == "local":
        pytest.skip("the holder is another process only for network transports")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, kind], stdout=subprocess.PIPE)
    try:
        ep = Endpoint.from_dict(json.loads(proc.stdout.readline()))
        puller = make_transport(kind)
        puller.start(torch.zeros(8, 2, 512, 16, 8, 64), "puller")
        t0 = time.monotonic()
        t = puller.pull(ep, "big", list(range(512)), list(range(512)), timeout_s=3.0)
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
