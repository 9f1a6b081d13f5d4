"""TCP transport: no dependency beyond the standard library.

Wire format, one pull per connection: the puller sends a framed JSON request (4-byte
big-endian length + JSON); the holder answers a framed JSON header and then, for a pull,
`nbytes` of block data in wire order (`[layers, 2, n, block_size, kv_heads, head_dim]`);
both sides move the bytes with scatter/gather I/O straight between the caches (`sendmsg`
from the holder's blocks, `recvmsg_into` the puller's destination blocks: no staging copy,
runs of consecutive block ids become one buffer), then the puller sends a framed `ack`, on which the holder ends
the lease ("pulled") and confirms, so a finished Transfer means a released lease. A connection lost before the ack leaves the lease held until it
expires, so a retry can still succeed.

Holder: a thread per connection. Puller: a small thread pool; the `Transfer` it returns
is polled by the engine loop.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.kv_transfer.base import (Endpoint, KVLayout, KVTransport, LayoutMismatchError,
                                    LeaseExpiredError, PeerUnreachableError, Transfer,
                                    TransferError, TransferTimeoutError, check_pull)
from baton.kv_transfer.leases import LeaseTable

_LEN = struct.Struct(">I")
_ERRORS = {"layout": LayoutMismatchError, "lease": LeaseExpiredError}


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _recv_msg(sock: socket.socket) -> dict:
    head = bytearray(4)
    _recv_exact(sock, memoryview(head))
    body = bytearray(_LEN.unpack(head)[0])
    _recv_exact(sock, memoryview(body))
    return json.loads(body)


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


_IOV_MAX = 1024


def block_views(kv_cache: torch.Tensor, cache_bytes: memoryview, block_ids: list[int]
                ) -> list[memoryview]:
    """The blocks' memory in wire order (layer, K/V, then the blocks in the given order), as
    views into the cache itself: runs of consecutive ids become one view each."""
    layers2, nb = kv_cache.shape[0] * 2, kv_cache.shape[2]
    seg = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    views = []
    for lk in range(layers2):
        base = lk * nb
        for start, length in runs:
            off = (base + start) * seg
            views.append(cache_bytes[off:off + length * seg])
    return views


def _send_views(sock: socket.socket, views: list[memoryview]) -> int:
    """sendmsg scatter/gather straight from the cache, IOV_MAX buffers a call."""
    total = 0
    i = 0
    while i < len(views):
        batch = views[i:i + _IOV_MAX]
        sent = sock.sendmsg(batch)
        total += sent
        while batch and sent >= len(batch[0]):  # drop the fully sent buffers
            sent -= len(batch[0])
            batch.pop(0)
            i += 1
        if batch and sent:
            views[i] = batch[0][sent:]
    return total


def _recv_views(sock: socket.socket, views: list[memoryview], remaining, peer_address: str
                ) -> int:
    """recvmsg_into straight into the cache's destination blocks."""
    total = 0
    i = 0
    want = sum(len(v) for v in views)
    while i < len(views):
        sock.settimeout(remaining())
        got = sock.recvmsg_into(views[i:i + _IOV_MAX])[0]
        if got == 0:
            raise PeerUnreachableError(f"{peer_address} closed the connection after {total} "
                                       f"of {want} bytes")
        total += got
        while i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]
    return total


class TcpTransport(KVTransport):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_pulls: int = 8) -> None:
        self.host, self.port = host, port
        self.kv_cache: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self.endpoint: Endpoint | None = None
        self.leases = LeaseTable()
        self._server: socket.socket | None = None
        self._closed = threading.Event()
        self._connected: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=max_pulls, thread_name_prefix="kv-tcp")

    # -- holder ----------------------------------------------------------------------------
    def start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        if kv_cache.device.type != "cpu":
            raise ValueError("the tcp transport moves host memory; use nixl or nccl for GPUs")
        return self._start(kv_cache, engine_id)

    def _start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        if not kv_cache.is_contiguous():
            raise ValueError("the tcp transport needs a contiguous KV cache tensor")
        self.kv_cache, self.layout = kv_cache, KVLayout.of(kv_cache)
        self._cache_bytes = _byte_view(kv_cache.view(-1))
        srv = socket.create_server((self.host, self.port), backlog=128)
        self._server = srv
        host, port = srv.getsockname()[:2]
        self.endpoint = Endpoint(self.name, engine_id, f"{host}:{port}", self.layout)
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()
        return self.endpoint

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(60)
            try:
                req = _recv_msg(conn)
                if req.get("fingerprint") != self.layout.fingerprint:
                    _send_msg(conn, {"ok": False, "kind": "layout", "error":
                                     f"layout mismatch: holder has {self.layout}"})
                    return
                if req["op"] == "hello":
                    _send_msg(conn, self._hello())
                elif req["op"] == "pull":
                    self._serve_pull(conn, req["request_id"], req["src"])
            except (OSError, ValueError, KeyError):
                return  # the puller sees the connection drop

    def _hello(self) -> dict:
        """The holder's answer to a puller's hello (after the layout check)."""
        return {"ok": True}

    def _serve_pull(self, conn: socket.socket, request_id: str, src: list[int]) -> None:
        try:
            blocks = self.leases.take(request_id, src)
        except LeaseExpiredError as err:
            _send_msg(conn, {"ok": False, "kind": "lease", "error": str(err)})
            return
        acked = False
        try:
            self._send_blocks(conn, blocks)
            acked = _recv_msg(conn).get("op") == "ack"
        finally:
            if acked:
                self.leases.complete(request_id)
            else:
                self.leases.abandon(request_id)
        _send_msg(conn, {"ok": True, "released": True})

    def _send_blocks(self, conn: socket.socket, blocks: list[int]) -> None:
        """The data phase, holder side: a header, then the blocks' bytes on `conn`."""
        views = block_views(self.kv_cache, self._cache_bytes, blocks)
        _send_msg(conn, {"ok": True, "nbytes": sum(len(v) for v in views)})
        _send_views(conn, views)

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float) -> None:
        self.leases.hold(request_id, block_ids, ttl_s)

    def released(self) -> list[tuple[str, str]]:
        return self.leases.released()

    # -- puller ----------------------------------------------------------------------------
    def _open(self, peer: Endpoint, timeout_s: float) -> socket.socket:
        host, port = peer.address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(timeout_s, 0.001))
        except OSError as err:
            raise PeerUnreachableError(f"cannot reach {peer.engine_id} at {peer.address}: "
                                       f"{err}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def connect(self, peer: Endpoint, timeout_s: float = 5.0) -> None:
        self._check_layout(peer)
        if peer.address in self._connected:
            return
        self._say_hello(peer, timeout_s)
        self._connected.add(peer.address)

    def _check_layout(self, peer: Endpoint) -> None:
        if peer.layout.fingerprint != self.layout.fingerprint:
            raise LayoutMismatchError(f"peer {peer.engine_id} has layout {peer.layout}, "
                                      f"ours is {self.layout}")

    def _say_hello(self, peer: Endpoint, timeout_s: float) -> dict:
        """The handshake: the holder checks our layout and answers `_hello()`."""
        with self._open(peer, timeout_s) as sock:
            try:
                sock.settimeout(timeout_s)
                _send_msg(sock, {"op": "hello", "fingerprint": self.layout.fingerprint})
                reply = _recv_msg(sock)
            except TimeoutError:
                raise TransferTimeoutError(f"handshake with {peer.address} timed out") \
                    from None
            except (OSError, ValueError) as err:
                raise PeerUnreachableError(f"handshake with {peer.address} failed: "
                                           f"{err}") from None
        self._check(reply)
        return reply

    @staticmethod
    def _check(reply: dict) -> None:
        if not reply.get("ok"):
            raise _ERRORS.get(reply.get("kind"), TransferError)(reply.get("error", "refused"))

    def pull(self, peer: Endpoint, request_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], timeout_s: float) -> Transfer:
        check_pull(self.layout, src_block_ids, dst_block_ids, self.kv_cache.shape[2])
        transfer = Transfer(request_id, len(dst_block_ids))
        if peer.layout.fingerprint != self.layout.fingerprint:
            transfer._fail(LayoutMismatchError(f"peer {peer.engine_id} has layout "
                                               f"{peer.layout}, ours is {self.layout}"))
            return transfer
        self._pool.submit(self._pull, transfer, peer, request_id, list(src_block_ids),
                          list(dst_block_ids), time.monotonic() + timeout_s)
        return transfer

    def _pull(self, transfer: Transfer, peer: Endpoint, request_id: str, src: list[int],
              dst: list[int], deadline: float) -> None:
        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"pulling {len(src)} blocks of {request_id!r} "
                                           f"from {peer.address} timed out")
            return left

        try:
            with self._open(peer, remaining()) as sock:
                transfer._transferring()
                sock.settimeout(remaining())
                _send_msg(sock, {"op": "pull", "request_id": request_id, "src": src,
                                 "fingerprint": self.layout.fingerprint})
                reply = _recv_msg(sock)
                self._check(reply)
                got = self._receive(sock, reply, src, dst, remaining, peer)
                _send_msg(sock, {"op": "ack"})
                try:  # the holder has ended the lease once this arrives
                    _recv_msg(sock)
                except OSError:
                    pass  # our blocks are complete; the holder's lease expires instead
            transfer._succeed(got)
        except TransferError as err:
            transfer._fail(err)
        except TimeoutError:
            transfer._fail(TransferTimeoutError(f"pulling {request_id!r} from {peer.address} "
                                                "timed out"))
        except (OSError, ValueError) as err:
            transfer._fail(PeerUnreachableError(f"lost {peer.address} during the transfer of "
                                                f"{request_id!r}: {err!r}"))
        except Exception as err:  # noqa: BLE001 - never leave a transfer hanging
            transfer._fail(TransferError(f"pulling {request_id!r} failed: {err!r}"))

    def _receive(self, sock: socket.socket, reply: dict, src: list[int], dst: list[int],
                 remaining, peer: Endpoint) -> int:
        """The data phase, puller side: the peer's `src` blocks straight into our `dst`
        blocks (no staging copy)."""
        nbytes = reply["nbytes"]
        views = block_views(self.kv_cache, self._cache_bytes, dst)
        want = sum(len(v) for v in views)
        if nbytes != want:
            raise TransferError(f"holder sent {nbytes} bytes, expected {want}")
        return _recv_views(sock, views, remaining, peer.address) if want else 0

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        self.leases.release_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
