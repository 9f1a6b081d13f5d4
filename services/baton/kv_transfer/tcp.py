"""TCP transport: no dependency beyond the standard library.

Wire format, one pull per connection: the puller sends a framed JSON request (4-byte
big-endian length + JSON); the holder answers a framed JSON header and then, for a pull,
`nbytes` of block data in wire order (`[layers, 2, n, block_size, kv_heads, head_dim]`);
the puller receives straight into a staging tensor (`recv_into`, no intermediate bytes),
copies it into its destination blocks and sends a framed `ack`, on which the holder ends
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
                                    TransferError, TransferTimeoutError, check_pull,
                                    gather_blocks, scatter_blocks)
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
        self.kv_cache, self.layout = kv_cache, KVLayout.of(kv_cache)
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
                    _send_msg(conn, {"ok": True})
                elif req["op"] == "pull":
                    self._serve_pull(conn, req["request_id"], req["src"])
            except (OSError, ValueError, KeyError):
                return  # the puller sees the connection drop

    def _serve_pull(self, conn: socket.socket, request_id: str, src: list[int]) -> None:
        try:
            blocks = self.leases.take(request_id, src)
        except LeaseExpiredError as err:
            _send_msg(conn, {"ok": False, "kind": "lease", "error": str(err)})
            return
        acked = False
        try:
            data = gather_blocks(self.kv_cache, blocks).contiguous() if blocks else None
            nbytes = 0 if data is None else data.numel() * data.element_size()
            _send_msg(conn, {"ok": True, "nbytes": nbytes})
            if data is not None:
                conn.sendall(_byte_view(data))
            acked = _recv_msg(conn).get("op") == "ack"
        finally:
            if acked:
                self.leases.complete(request_id)
            else:
                self.leases.abandon(request_id)
        _send_msg(conn, {"ok": True, "released": True})

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
        if peer.layout.fingerprint != self.layout.fingerprint:
            raise LayoutMismatchError(f"peer {peer.engine_id} has layout {peer.layout}, "
                                      f"ours is {self.layout}")
        if peer.address in self._connected:
            return
        with self._open(peer, timeout_s) as sock:
            try:
                _send_msg(sock, {"op": "hello", "fingerprint": self.layout.fingerprint})
                self._check(_recv_msg(sock))
            except (OSError, ValueError) as err:
                raise PeerUnreachableError(f"handshake with {peer.address} failed: "
                                           f"{err}") from None
        self._connected.add(peer.address)

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
                got = self._receive(sock, reply["nbytes"], len(src), dst, remaining, peer)
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

    def _receive(self, sock: socket.socket, nbytes: int, n: int, dst: list[int], remaining,
                 peer: Endpoint) -> int:
        """Receive n blocks straight into a staging tensor, then into our blocks."""
        if n == 0:
            if nbytes:
                raise TransferError(f"holder sent {nbytes} bytes for an empty transfer")
            return 0
        lay = self.layout
        staging = torch.empty((lay.num_layers, 2, n, lay.block_size, lay.num_kv_heads,
                               lay.head_dim), dtype=self.kv_cache.dtype)
        view = _byte_view(staging)
        if nbytes != len(view):
            raise TransferError(f"holder sent {nbytes} bytes, expected {len(view)}")
        got = 0
        while got < len(view):
            sock.settimeout(remaining())
            k = sock.recv_into(view[got:], min(len(view) - got, 1 << 22))
            if k == 0:
                raise PeerUnreachableError(f"{peer.address} closed the connection after "
                                           f"{got} of {len(view)} bytes")
            got += k
        scatter_blocks(self.kv_cache, dst, staging)
        return got

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        self.leases.release_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
