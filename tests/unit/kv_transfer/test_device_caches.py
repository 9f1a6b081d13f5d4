"""Transports over a cache that is not in host memory, without a GPU: a KV cache on the
`meta` device has no data, so any code that takes a host view of it (`.numpy()`,
`.tolist()`, a memoryview) fails or is recorded here, and a copy out of it fails as a
device copy would. Every transport must start, say hello, connect and run a pull up to
where bytes move, then fail that pull with a typed TransferError — never at start, never a
hang — and leave the lease to expire as any failed pull does."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer import installed_transports, make_transport
from baton.kv_transfer.base import (
    LayoutMismatchError,
    TransferError,
    TransferState,
    bytes_per_block,
)
from baton.kv_transfer.wire import recv_magic, recv_msg, send_msg
from tests.unit.kv_transfer.factories import cache

SHAPE = (4, 2, 16, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
NUMEL = 4 * 2 * 16 * 4 * 2 * 8


def meta_cache() -> torch.Tensor:
    return torch.empty(SHAPE, dtype=torch.float32, device="meta")


@pytest.fixture
def host_views(monkeypatch):
    """Every `.numpy()` / `.tolist()` (and so every memoryview, `np.asarray`) taken of a
    meta tensor or of a tensor the size of the cache, while the test runs."""
    calls: list[str] = []
    sizes = {NUMEL, NUMEL * 4}  # the cache's elements, or its bytes

    def spy(name):
        original = getattr(torch.Tensor, name)

        def recorded(self, *args, **kwargs):
            if self.device.type == "meta" or self.numel() in sizes:
                calls.append(f"{name}() of a {self.device.type} tensor {tuple(self.shape)}")
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, recorded)

    for name in ("numpy", "tolist", "__array__"):
        spy(name)
    return calls


@pytest.fixture
def fake_meta_registration(monkeypatch):
    """UCX cannot register memory that does not exist: NIXL's agent stands in for a
    device's registration with a token for a meta tensor (everything else is real)."""
    if "nixl" not in installed_transports():
        pytest.skip("nixl is not installed")
    from baton.kv_transfer.nixl import _import_nixl

    agent = _import_nixl().nixl_agent
    real = agent.register_memory

    def register(self, reg_list, *args, **kwargs):
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in reg_list):
            return "meta-registration"
        return real(self, reg_list, *args, **kwargs)
    monkeypatch.setattr(agent, "register_memory", register)


def _wait_released(holder, seconds: float = 5.0) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        events = holder.released()
        if events:
            return events
        time.sleep(0.02)
    return []


def _meta_pull_fails_cleanly(kind: str) -> None:
    holder, puller = make_transport(kind), make_transport(kind)
    try:
        ep = holder.start(meta_cache(), "holder")
        puller.start(meta_cache(), "puller")
        assert ep.layout.device == "meta" and to_jsonable_python(ep)["layout"]["device"] == "meta"
        puller.connect(ep)  # the hello (nixl: its agent metadata) and the layout check
        puller.connect(ep)
        lease = holder.hold("r-empty", [5], ttl_s=30)  # a release moves no bytes
        assert puller.pull(ep, lease, [], [], 5).wait(10) == TransferState.DONE
        assert holder.released() == [("r-empty", "pulled")]
        lease = holder.hold("r", [1, 2, 3], ttl_s=0.5)
        t = puller.pull(ep, lease, [1, 2, 3], [4, 5, 9], timeout_s=5)
        assert t.wait(8) == TransferState.FAILED, "the pull hung"
        assert isinstance(t.error, TransferError), repr(t.error)
        assert t.finished - t.started < 5
        assert _wait_released(holder) == [("r", "expired")]  # not leaked, not "pulled"
    finally:
        puller.close()
        holder.close()


def test_tcp_serves_and_pulls_a_device_cache_without_a_host_view(host_views):
    _meta_pull_fails_cleanly("tcp")
    assert host_views == []


def test_the_tcp_holder_tells_the_puller_why_it_cannot_read_its_blocks():
    holder, puller = make_transport("tcp"), make_transport("tcp")
    try:
        ep = holder.start(meta_cache(), "holder")
        puller.start(meta_cache(), "puller")
        lease = holder.hold("r", [1], ttl_s=30)
        t = puller.pull(ep, lease, [1], [1], timeout_s=5)
        assert t.wait(8) == TransferState.FAILED
        assert type(t.error) is TransferError and "could not copy its meta KV" in str(t.error)
        t = puller.pull(ep, lease, [1], [1], timeout_s=5)  # still held for its puller
        assert t.wait(8) == TransferState.FAILED and "could not copy" in str(t.error)
    finally:
        puller.close()
        holder.close()


def test_nixl_registers_a_device_cache_as_is_and_never_views_it(host_views,
                                                                fake_meta_registration):
    _meta_pull_fails_cleanly("nixl")
    assert host_views == []


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_gloo_and_nccl_refuse_a_cache_of_another_device_at_start(backend, host_views):
    with pytest.raises(ValueError, match="not a meta one"):
        make_transport(backend).start(meta_cache(), "holder")
    assert host_views == []


def _fake_holder(srv: socket.socket, nbytes: int, sent: list) -> None:
    """A holder without a secret that serves `nbytes` of data to one pull."""
    conn, _ = srv.accept()
    with conn:
        recv_magic(conn, time.monotonic() + 5)
        recv_msg(conn)
        send_msg(conn, {"ok": True})
        recv_msg(conn)  # the pull request
        send_msg(conn, {"ok": True})
        send_msg(conn, {"ok": True, "nbytes": nbytes})
        conn.sendall(b"\x01" * nbytes)
        sent.append(recv_msg(conn).get("op"))
        send_msg(conn, {"ok": True, "released": True})


def test_a_device_puller_takes_every_byte_through_staging_without_a_host_view(host_views):
    puller = make_transport("tcp", staging_bytes=1000)  # chunks of 3 units (256 bytes)
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        puller.start(meta_cache(), "puller")
        layout = puller.layout
        ep = KVEndpointInfo("tcp", "holder", f"127.0.0.1:{srv.getsockname()[1]}", layout)
        nbytes, sent = 3 * bytes_per_block(layout), []
        threading.Thread(target=_fake_holder, args=(srv, nbytes, sent), daemon=True).start()
        t = puller.pull(ep, "lease", [1, 2, 3], [7, 8, 12], timeout_s=5)
        assert t.wait(8) == TransferState.DONE, t.error
        assert t.bytes == nbytes and sent == ["ack"]
    finally:
        srv.close()
        puller.close()
    assert host_views == []


def test_a_layout_names_its_device_and_a_layout_without_one_is_a_host_cache():
    host, meta = KVLayoutInfo.of(cache()), KVLayoutInfo.of(meta_cache())
    assert host.device == "cpu" and meta.device == "meta"
    assert "device" not in to_jsonable_python(host)  # the wire of before for a host cache
    assert KVLayoutInfo(**to_jsonable_python(host)) == host
    assert KVLayoutInfo(**to_jsonable_python(meta)) == meta
    assert host.fingerprint != meta.fingerprint
    assert "device meta vs cpu" in meta.mismatch(host)
    cuda = KVLayoutInfo(**{**to_jsonable_python(host), "device": "cuda"})
    assert cuda.fingerprint not in (host.fingerprint, meta.fingerprint)
    with pytest.raises(LayoutMismatchError, match="device"):
        puller = make_transport("tcp")
        try:
            puller.start(cache(), "p")
            puller.connect(KVEndpointInfo("tcp", "h", "127.0.0.1:1", cuda))
        finally:
            puller.close()


def test_a_device_layout_survives_the_transfer_params():
    for device in ("cpu", "cuda"):
        lay = KVLayoutInfo(**{**to_jsonable_python(KVLayoutInfo.of(cache())), "device": device})
        ep = KVEndpointInfo("tcp", "e", "127.0.0.1:1", lay)
        wire = to_jsonable_python(ep)
        assert TypeAdapter(KVEndpointInfo).validate_python(wire) == ep
        assert ("device" in wire["layout"]) == (device != "cpu")
