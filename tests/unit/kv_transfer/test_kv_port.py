"""Junk on the KV port never hurts the holder: a real tcp holder on loopback, raw sockets.

Lying frame headers, an HTTP request, deeply nested JSON, silence and trickles are refused
(at once, or at the handshake deadline) without growing the holder's memory, and a legit
pull beside them goes through. A puller does not trust a holder's frames either.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest
import torch

from baton.kv_transfer import installed_transports, make_transport
from baton.kv_transfer.base import (
    KVAuthError,
    PeerUnreachableError,
    TransferState,
    bytes_per_block,
)
from baton.kv_transfer.wire import MAGIC, MAX_FRAME_BYTES, send_msg
from tests.unit.kv_transfer.factories import OTHER_SECRET, SECRET, cache, closed_within, rss_bytes

MiB = 1 << 20
JUNK = {
    "frame-claiming-256MiB": MAGIC + struct.pack(">I", 256 * MiB) + b"x" * 100,
    "headerless-256MiB-v1": struct.pack(">I", 256 * MiB) + b"{}",
    "http-get": b"GET / HTTP/1.1\r\nHost: kv\r\nUser-Agent: curl\r\n\r\n",
    "nested-json": MAGIC + struct.pack(">I", 200_000) + b"[" * 200_000,
    "not-an-object": MAGIC + struct.pack(">I", 2) + b"[]",
    "older-version": b"BATONKV\x01" + struct.pack(">I", 2) + b"{}",
}


# Transports on tcp's control plane: the junk tests run against each installed one.
NETWORK = [k for k in ("tcp", "gloo", "nixl") if k in installed_transports()]


@pytest.fixture
def pair():
    made = []

    def _pair(kind="tcp", **holder_kwargs):
        holder, puller = make_transport(kind, **holder_kwargs), make_transport(kind)
        made.extend([holder, puller])
        src_kv, dst_kv = cache(blocks=64), cache(blocks=64, fill=False)
        ep = holder.start(src_kv, "holder")
        puller.start(dst_kv, "puller")
        return holder, puller, ep, src_kv, dst_kv

    yield _pair
    for t in made:
        t.close()


def raw(ep) -> socket.socket:
    host, port = ep.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def quietly(serve) -> None:
    """Run a fake holder; the puller hanging up on it is the point, not an error."""
    try:
        serve()
    except OSError:
        pass


def pull_ok(holder, puller, ep, src_kv, dst_kv, rid: str, blocks: list[int]) -> float:
    """A legit pull's seconds; asserts it delivered the right bytes."""
    lease = holder.hold(rid, blocks, 30)
    t = puller.pull(ep, lease, blocks, blocks, 10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, blocks], src_kv[:, :, blocks])
    return t.finished - t.started


@pytest.mark.parametrize("kind", NETWORK)
def test_junk_is_refused_at_once_and_never_grows_the_holder(pair, caplog, kind):
    holder, puller, ep, src_kv, dst_kv = pair(kind)
    pull_ok(holder, puller, ep, src_kv, dst_kv, "warm-up", [0, 1])
    before = rss_bytes()
    with caplog.at_level(logging.WARNING, logger="baton.kv_transfer"):
        for name, payload in JUNK.items():
            with raw(ep) as sock:
                sock.sendall(payload)
                took = closed_within(sock, 2.0)
                assert took is not None and took < 1.0, f"{name}: still open after 2 s"
    grown = rss_bytes() - before
    assert grown < 8 * MiB, f"the holder grew by {grown / MiB:.1f} MiB"
    assert holder.refused.total == len(JUNK)
    # One line a second, whatever the flood: the first refusal's, with its reason.
    assert caplog.text.count("refused a connection") == 1
    assert "a frame of 268435456 bytes is over the 1048576-byte limit" in caplog.text
    pull_ok(holder, puller, ep, src_kv, dst_kv, "after", [2, 3])


@pytest.mark.parametrize("kind", NETWORK)
def test_a_legit_pull_goes_through_beside_stuck_connections(pair, kind):
    holder, puller, ep, src_kv, dst_kv = pair(kind, handshake_timeout_s=5.0)
    stuck = [raw(ep) for _ in range(4)]
    stuck[1].sendall(MAGIC)  # half a handshake
    stuck[2].sendall(MAGIC + struct.pack(">I", 256 * MiB))  # a frame too large: refused
    stuck[3].sendall(MAGIC + struct.pack(">I", 1000) + b"{")  # a frame that never ends
    try:
        assert pull_ok(holder, puller, ep, src_kv, dst_kv, "beside", list(range(32))) < 1.0
    finally:
        for sock in stuck:
            sock.close()


def test_silent_and_trickling_connections_are_closed_at_the_handshake_deadline(pair):
    holder, puller, ep, src_kv, dst_kv = pair(handshake_timeout_s=0.5)
    silent, trickle = raw(ep), raw(ep)
    stop = threading.Event()

    def drip():  # a valid start, one byte every 50 ms: each read is quick, the whole is not
        data = MAGIC + struct.pack(">I", 400) + b"{" + b" " * 399
        for byte in data:
            if stop.wait(0.05):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    t0 = time.monotonic()
    try:
        for sock in (silent, trickle):
            assert closed_within(sock, 3.0) is not None
            assert 0.3 < time.monotonic() - t0 < 2.0
    finally:
        stop.set()
        silent.close()
        trickle.close()
    assert holder.refused.total == 2
    pull_ok(holder, puller, ep, src_kv, dst_kv, "after", [5])


def test_connections_past_the_handshake_cap_are_closed_at_once(pair):
    holder, puller, ep, src_kv, dst_kv = pair(handshake_timeout_s=0.5, max_handshakes=2)
    waiting = [raw(ep) for _ in range(2)]
    time.sleep(0.1)  # both are in their handshake
    with raw(ep) as extra:
        took = closed_within(extra, 2.0)
        assert took is not None and took < 0.3
    for sock in waiting:
        assert closed_within(sock, 3.0) is not None
        sock.close()
    pull_ok(holder, puller, ep, src_kv, dst_kv, "after", [7])


def test_the_frame_limit_holds_and_fits_large_pulls(pair):
    holder, puller, ep, src_kv, dst_kv = pair(max_frame_bytes=4096)
    with raw(ep) as sock:  # a hello one byte over the limit
        sock.sendall(MAGIC + struct.pack(">I", 4097) + b" " * 4097)
        assert closed_within(sock, 1.0) is not None
    big, _ = make_transport("tcp"), None
    try:  # a pull of 2,000 block ids under the default limit
        kv = torch.randn(1, 2, 4096, 1, 1, 2)
        ep2 = big.start(kv, "big")
        sink = make_transport("tcp")
        dst = torch.zeros_like(kv)
        sink.start(dst, "sink")
        ids = list(range(0, 4000, 2))
        lease = big.hold("r", ids, 30)
        assert sink.pull(ep2, lease, ids, ids, 10).wait(10) == TransferState.DONE
        assert torch.equal(dst[:, :, ids], kv[:, :, ids])
        sink.close()
    finally:
        big.close()
    assert MAX_FRAME_BYTES >= 1 << 20


def test_wrong_secret_is_logged_on_the_holder_and_typed_on_the_puller(pair, caplog):
    holder, _, ep, src_kv, _ = pair(secret=SECRET)
    stranger = make_transport("tcp", secret=OTHER_SECRET)
    stranger.start(cache(blocks=64, fill=False), "stranger")
    try:
        lease = holder.hold("r", [1], 30)
        with caplog.at_level(logging.WARNING, logger="baton.kv_transfer"):
            t = stranger.pull(ep, lease, [1], [1], 10)
            assert t.wait(10) == TransferState.FAILED
            deadline = time.monotonic() + 2
            while holder.refused.total == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the holder logs once it has told the puller
        assert isinstance(t.error, KVAuthError) and "secrets differ" in str(t.error)
        assert "stranger@127.0.0.1: wrong KV secret" in caplog.text
        assert holder.refused.total == 1
    finally:
        stranger.close()


def test_a_holder_without_the_key_cannot_feed_a_puller(pair):
    """A fake holder that skips the proof: the puller refuses before reading any data."""
    _, puller, ep, _, dst_kv = pair()
    puller.secret = SECRET
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]

    def serve():
        conn, _ = fake.accept()
        with conn:
            conn.recv(65536)
            send_msg(conn, {"ok": True, "nonce": "0" * 32})
            conn.recv(65536)
            send_msg(conn, {"ok": True, "proof": "f" * 64})
            send_msg(conn, {"ok": True, "nbytes": 2 * bytes_per_block(ep.layout)})
            conn.sendall(b"\x7f" * 2 * bytes_per_block(ep.layout))

    threading.Thread(target=quietly, args=(serve,), daemon=True).start()
    try:
        fake_ep = type(ep)(ep.transport, "holder", f"127.0.0.1:{port}", ep.layout)
        t = puller.pull(fake_ep, "lease", [0, 1], [0, 1], 5)
        assert t.wait(10) == TransferState.FAILED and isinstance(t.error, KVAuthError)
        assert not dst_kv.any()
    finally:
        fake.close()


def test_a_puller_does_not_trust_a_holders_frame_sizes(pair):
    _, puller, ep, _, _ = pair()
    fake = socket.create_server(("127.0.0.1", 0))
    port = fake.getsockname()[1]

    def serve():
        conn, _ = fake.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(struct.pack(">I", 1 << 30))  # "here comes 1 GiB"
            time.sleep(3)

    threading.Thread(target=quietly, args=(serve,), daemon=True).start()
    try:
        before = rss_bytes()
        fake_ep = type(ep)(ep.transport, "holder", f"127.0.0.1:{port}", ep.layout)
        t = puller.pull(fake_ep, "lease", [0], [0], 5)
        assert t.wait(2) == TransferState.FAILED
        assert isinstance(t.error, PeerUnreachableError) and "limit" in str(t.error)
        assert rss_bytes() - before < 8 * MiB
    finally:
        fake.close()


def from_other_host(ep) -> socket.socket:
    """A connection from 127.0.0.2: another peer address than the puller's 127.0.0.1."""
    host, port = ep.address.rsplit(":", 1)
    sock = socket.socket()
    sock.bind(("127.0.0.2", 0))
    sock.settimeout(5)
    sock.connect((host, int(port)))
    return sock


def test_silent_connections_from_one_host_leave_the_handshake_slots_to_pullers(pair):
    # 70 silent connections from one address, past the 64 slots, with a long handshake
    # deadline: they hold at most their address's share, and each only until its hello is
    # due; a puller from another address pulls meanwhile, at once.
    holder, puller, ep, src_kv, dst_kv = pair(handshake_timeout_s=30.0)
    silent = [from_other_host(ep) for _ in range(70)]
    try:
        time.sleep(0.2)  # all accepted: those past the per-address bound already closed
        assert pull_ok(holder, puller, ep, src_kv, dst_kv, "beside", [1, 2]) < 1.0
        t0 = time.monotonic()
        for sock in silent:
            assert closed_within(sock, 5.0) is not None
        assert time.monotonic() - t0 < 2.0, "silent connections held their slots too long"
    finally:
        for sock in silent:
            sock.close()
    assert holder.refused.total == 70


def from_host(ep, host: str) -> socket.socket:
    address, port = ep.address.rsplit(":", 1)
    sock = socket.socket()
    sock.bind((host, 0))
    sock.settimeout(5)
    sock.connect((address, int(port)))
    return sock


def test_a_flood_from_many_addresses_cannot_keep_a_puller_out(pair):
    # 8 addresses x 4 silent connections fill all 32 slots (4 per address is within the
    # per-address bound) with a long hello deadline: a puller from yet another address
    # still pulls at once — the address holding the most gives up its oldest slot.
    holder, puller, ep, src_kv, dst_kv = pair(handshake_timeout_s=30.0, max_handshakes=32)
    flood = [from_host(ep, f"127.0.0.{10 + i}") for i in range(8) for _ in range(4)]
    try:
        time.sleep(0.2)  # all 32 in their handshake
        assert pull_ok(holder, puller, ep, src_kv, dst_kv, "past-a-flood", [3]) < 1.0
        assert any(closed_within(sock, 0.5) is not None for sock in flood)
    finally:
        for sock in flood:
            sock.close()
