"""TCP transport: no dependency beyond the standard library; any device's cache.

Control plane (shared with gloo / nccl and nixl), one request per connection: the
handshake of `handshake.py` over the bounded frames of `wire.py` (magic and version, layout
fingerprint, the HMAC challenge when a secret is configured), then the request: `info` (the
holder's hello: nothing here, NIXL's agent metadata there) or `pull` (a lease id and the
holder's block ids). For a pull the holder answers a header and then `nbytes` of block data
in wire order (`[layers, 2, n, block_size, kv_heads, head_dim]`), or, when it cannot read
its blocks, a refusal instead of the header (the puller's TransferError). Then the puller
sends a framed `ack`, on which the holder ends the lease ("pulled") and confirms, so a
finished Transfer means a released lease. A connection lost before the ack leaves the lease
held (bound to its puller) until it expires, so that puller's retry can still succeed.

How the bytes move depends on where each side's cache lives, never on the peer (the wire
is the same): a host cache is read and written in place with scatter/gather I/O
(`iov.py`: `sendmsg` from the holder's blocks, `recvmsg_into` the puller's destination
blocks, runs of consecutive block ids as one buffer, no copy); any other cache (CUDA) goes
through a bounded host staging buffer, chunk by chunk (`staging.py`; pinned on CUDA),
which `stage_via_host=True` forces on a host cache too. The control plane never takes a
host view of a device cache.

Across tensor-parallel degrees a pull may name `heads`, a range of the holder rank's KV
heads (wire order then: layer, K/V, block, token, those heads, moved as one view per token
of each side's host cache, or one strided copy per run of blocks when staged), and `part`
(i, n): the lease ends when all n of the puller's ranks reading it have acknowledged.
gloo / nixl move whole shards only.

Nothing a peer sends sizes an allocation: frames are bounded, block ids must fall inside
the holder's cache and its lease, the data's size follows from the ids each side knows.

Holder: an accept thread, at most `max_handshakes` connections in their handshake at once
(more are closed at once), a thread per connection. Puller: a small thread pool; the
`Transfer` it returns is polled by the engine loop.
"""

# size: the holder server and the puller of the tcp control plane, which gloo and nixl
# inherit; it splits into a control plane and data planes behind one protocol (issue 33).
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.kv_transfer import handshake
from baton.kv_transfer.base import (
    Endpoint,
    KVLayout,
    KVTransport,
    LayoutMismatchError,
    LeaseExpiredError,
    PeerUnreachableError,
    Transfer,
    TransferError,
    TransferTimeoutError,
    check_pull,
)
from baton.kv_transfer.handshake import HolderTerms, PullerTerms, Refused
from baton.kv_transfer.iov import block_views, host_bytes, recv_views, send_views
from baton.kv_transfer.leases import LeaseTable, short
from baton.kv_transfer.messages import Ack, InfoRequest, PullRequest
from baton.kv_transfer.staging import STAGING_BYTES, StagingCopyError, StagingPool, wire_bytes
from baton.kv_transfer.wire import MAX_FRAME_BYTES, recv_msg, send_msg

log = logging.getLogger(__name__)
_DATA_TIMEOUT_S = 60.0  # an authenticated peer's data phase and ack


class DataUnavailable(Exception):
    """The holder cannot serve a pull's bytes (its device refused the copy, no staging
    buffer came free); raised before the data header, so the puller is told why."""


class TcpTransport(KVTransport):
    name = "tcp"
    head_subsets = True  # pulls may name a subset of the holder's KV heads (TP N -> M)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_pulls: int = 8,
                 secret: str | None = None,
                 handshake_timeout_s: float = handshake.HANDSHAKE_TIMEOUT_S,
                 max_frame_bytes: int = MAX_FRAME_BYTES, max_handshakes: int = 64,
                 heads: tuple[int, int, int] = (0, 0, 1), stage_via_host: bool | None = None,
                 staging_bytes: int = STAGING_BYTES) -> None:
        """`stage_via_host`: move the bytes through a bounded host buffer of
        `staging_bytes` (None: when the cache is not in host memory; True forces it on a
        host cache too, which tests use); tcp only."""
        if secret is not None and not secret:
            raise ValueError("the KV secret must be None (no authentication) or non-empty")
        if handshake_timeout_s <= 0 or max_frame_bytes < 4096 or max_handshakes < 1:
            raise ValueError(f"handshake_timeout_s={handshake_timeout_s} must be > 0, "
                             f"max_frame_bytes={max_frame_bytes} >= 4096, "
                             f"max_handshakes={max_handshakes} >= 1")
        self.host, self.port = host, port
        self.heads = tuple(heads)  # this rank's (head_start, total_kv_heads, tp_size)
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.stage_via_host, self.staging_bytes = stage_via_host, staging_bytes
        self._staging: StagingPool | None = None
        self._cache_bytes: memoryview | None = None  # a host cache's own bytes (zero-copy)
        self.kv_cache: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self.endpoint: Endpoint | None = None
        self.leases = LeaseTable()
        self.refused = handshake.RefusalLog()  # holder: connections refused, and their log
        self._handshakes = threading.BoundedSemaphore(max_handshakes)
        self._server: socket.socket | None = None
        self._closed = threading.Event()
        self._connected: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=max_pulls, thread_name_prefix="kv-tcp")

    # -- holder ----------------------------------------------------------------------------
    def start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        on_host = kv_cache.device.type == "cpu"
        if self.stage_via_host is False and not on_host:
            raise ValueError(f"a {kv_cache.device.type} KV cache has no host memory to send "
                             "from: tcp must stage it (stage_via_host None or True)")
        if kv_cache.is_contiguous():  # (else _start refuses it)
            if self.stage_via_host or not on_host:
                self._staging = StagingPool(kv_cache, self.staging_bytes)
            else:
                self._cache_bytes = host_bytes(kv_cache)
        return self._start(kv_cache, engine_id)

    def _start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        """The control plane, shared with gloo / nccl and nixl; never views the cache's
        memory (it may be a device's)."""
        if not kv_cache.is_contiguous():
            raise ValueError(f"the {self.name} transport needs a contiguous KV cache tensor")
        self.kv_cache, self.layout = kv_cache, KVLayout.of(kv_cache, *self.heads)
        self.leases.num_blocks = kv_cache.shape[2]
        srv = socket.create_server((self.host, self.port), backlog=128)
        self._server = srv
        host, port = srv.getsockname()[:2]
        self.endpoint = Endpoint(self.name, engine_id, f"{host}:{port}", self.layout)
        self._terms = HolderTerms(engine_id, str(self.layout), self.layout.fingerprint,
                                  kv_cache.shape[2], self.secret, self.handshake_timeout_s,
                                  self.max_frame_bytes)
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()
        return self.endpoint

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._server.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                self.refused(f"{addr[0]}: too many connections in their handshake")
                continue
            threading.Thread(target=self._serve, args=(conn, addr[0]), daemon=True).start()

    def _serve(self, conn: socket.socket, ip: str) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                session = self._accept_session(conn, ip)
            finally:
                self._handshakes.release()
            if session is None:
                return
            peer, req = session
            conn.settimeout(_DATA_TIMEOUT_S)
            try:
                if isinstance(req, InfoRequest):
                    send_msg(conn, self._hello())
                else:
                    self._serve_pull(conn, req, peer)
            except (OSError, ValueError):
                return  # the puller sees the connection drop

    def _accept_session(self, conn: socket.socket, ip: str
                        ) -> tuple[str, InfoRequest | PullRequest] | None:
        """The peer's identity and its request, or None: refused (and logged), or gone."""
        try:
            return handshake.accept(conn, ip, self._terms)
        except Refused as why:
            self.refused(str(why))
        except TimeoutError:
            self.refused(f"{ip}: no handshake within {self.handshake_timeout_s} s")
        except OSError:
            pass  # gone before its handshake (a TCP probe, a puller giving up)
        return None

    def _hello(self) -> dict:
        """The holder's answer to an authenticated `info` request."""
        return {"ok": True}

    def _local_heads(self, heads) -> tuple[int, int] | None:
        """A pull's global heads as our local [lo, hi), None for all; ValueError if we do
        not hold them all."""
        lo, hi = self.layout.heads
        if heads is None or list(heads) == [lo, hi]:
            return None
        if not (isinstance(heads, list) and len(heads) == 2
                and all(type(h) is int for h in heads) and lo <= heads[0] < heads[1] <= hi
                and self.head_subsets):
            raise ValueError(f"this holder serves KV heads [{lo}, {hi}) whole, not {heads}")
        return heads[0] - lo, heads[1] - lo

    def _serve_pull(self, conn: socket.socket, req: PullRequest, peer: str) -> None:
        """A pull `req` (checked by the handshake: a lease id and block ids in our cache)
        from the authenticated `peer`."""
        lease_id, src, heads = req.lease, req.src, req.heads
        part = req.part if req.part is not None else [0, 1]
        try:
            local = self._local_heads(heads)
            if not (isinstance(part, list | tuple) and len(part) == 2
                    and all(type(p) is int for p in part) and 0 <= part[0] < part[1] <= 64):
                raise ValueError(f"a malformed part {part!r}")
        except ValueError as err:
            send_msg(conn, {"ok": False, "kind": "layout", "error": str(err)})
            return
        try:
            blocks = self.leases.take(lease_id, src, peer, *part)
        except LeaseExpiredError as err:
            send_msg(conn, {"ok": False, "kind": "lease", "error": str(err)})
            return
        acked = False
        try:
            self._send_blocks(conn, blocks, local, peer, req)
            acked = recv_msg(conn, self.max_frame_bytes).get("op") == "ack"
        except DataUnavailable as err:  # the lease stays held, as for a dropped puller
            send_msg(conn, {"ok": False, "kind": "data", "error": str(err)})
            return
        finally:
            if acked:
                self.leases.complete(lease_id, part[0])
            else:
                self.leases.abandon(lease_id, part[0])
        send_msg(conn, {"ok": True, "released": True})

    def _send_blocks(self, conn: socket.socket, blocks: list[int],
                     heads: tuple[int, int] | None, peer: str, req: PullRequest) -> None:
        """The data phase, holder side: a header, then the blocks' bytes (of the local
        `heads` [lo, hi), None: all) on `conn` for `peer`'s pull `req`. Raises
        DataUnavailable before the header when the bytes cannot be had, OSError after."""
        if self._staging is not None:
            return self._send_staged(conn, blocks, heads or (0, self.kv_cache.shape[4]), peer)
        views = block_views(self.kv_cache, self._cache_bytes, blocks, heads)
        send_msg(conn, {"ok": True, "nbytes": sum(len(v) for v in views)})
        send_views(conn, views)

    def _send_staged(self, conn: socket.socket, blocks: list[int], heads: tuple[int, int],
                     peer: str) -> None:
        """Through a host buffer; the first chunk is copied before the header, so a device
        that refuses the copy is a typed refusal, not a cut stream."""
        nbytes = wire_bytes(self.kv_cache, len(blocks), heads)
        try:
            self._staging.send(conn, blocks, heads, _DATA_TIMEOUT_S,
                               lambda: send_msg(conn, {"ok": True, "nbytes": nbytes}))
        except TransferError as err:  # no buffer came free
            raise DataUnavailable(f"holder {self.endpoint.engine_id}: {err}") from None
        except StagingCopyError as err:
            why = (f"holder {self.endpoint.engine_id} could not copy its "
                   f"{self.kv_cache.device.type} KV blocks for {peer}: {err}")
            log.warning("%s", why)
            if err.began:
                raise ConnectionAbortedError(why) from None
            raise DataUnavailable(why) from None

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float) -> str:
        return self.leases.hold(request_id, block_ids, ttl_s)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

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

    def _request(self, sock: socket.socket, peer: Endpoint, req: InfoRequest | PullRequest,
                 deadline: float) -> dict:
        """Handshake on `sock` and send `req`; the holder's answer, checked."""
        me = self.endpoint.engine_id if self.endpoint else f"puller-{uuid.uuid4().hex[:8]}"
        terms = PullerTerms(me, self.layout.fingerprint, self.secret, self.max_frame_bytes)
        return handshake.request(sock, terms, peer, req, deadline)

    def connect(self, peer: Endpoint, timeout_s: float = 5.0) -> None:
        self._check_layout(peer)
        if peer.address in self._connected:
            return
        self._say_hello(peer, timeout_s)
        self._connected.add(peer.address)

    def _check_layout(self, peer: Endpoint) -> None:
        """Blocks of the same shape (whatever the TP degrees), and some of our heads."""
        why = self.layout.mismatch(peer.layout)
        (a, b), (lo, hi) = peer.layout.heads, self.layout.heads
        if not why and not self.head_subsets and (a, b) != (lo, hi):
            why = f"KV heads [{a}, {b}) vs ours [{lo}, {hi}) ({self.name} moves whole caches)"
        elif not why and not (a < hi and lo < b):
            why = f"it holds KV heads [{a}, {b}), none of ours [{lo}, {hi})"
        if why:
            raise LayoutMismatchError(f"peer {peer.engine_id} has an incompatible KV layout: "
                                      f"{why} (theirs {peer.layout}, ours {self.layout})")

    def _say_hello(self, peer: Endpoint, timeout_s: float) -> dict:
        """The handshake and an `info` request: the holder's `_hello()`."""
        with self._open(peer, timeout_s) as sock:
            try:
                return self._request(sock, peer, InfoRequest(op="info"),
                                     time.monotonic() + timeout_s)
            except TimeoutError:
                raise TransferTimeoutError(f"handshake with {peer.address} timed out") \
                    from None
            except (OSError, ValueError) as err:
                raise PeerUnreachableError(f"handshake with {peer.address} failed: "
                                           f"{err}") from None

    def pull(self, peer: Endpoint, lease_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], timeout_s: float,
             heads: tuple[int, int] | None = None, part: tuple[int, int] = (0, 1)
             ) -> Transfer:
        """`heads`: the global KV heads to move (default: all of ours), held by `peer` and
        by us; `part`: (i, n), the i-th of the n pulls of our engine's ranks that read this
        lease (`head_plan` computes both over a holder's ranks)."""
        check_pull(self.layout, src_block_ids, dst_block_ids, self.kv_cache.shape[2])
        transfer = Transfer(lease_id, len(dst_block_ids))
        empty = not src_block_ids  # a release: no heads move, any rank of the holder
        heads = tuple(heads) if heads is not None else \
            peer.layout.heads if empty else self.layout.heads
        try:
            why = self.layout.mismatch(peer.layout)
            if empty and why:
                raise LayoutMismatchError(f"peer {peer.engine_id} has an incompatible KV "
                                          f"layout: {why}")
            if not empty:
                self._check_layout(peer)
            (a, b), (lo, hi), (pa, pb) = heads, self.layout.heads, peer.layout.heads
            if not empty and not (lo <= a < b <= hi and pa <= a and b <= pb):
                raise LayoutMismatchError(f"KV heads [{a}, {b}) are not held by both peer "
                                          f"{peer.engine_id} [{pa}, {pb}) and us [{lo}, {hi})")
        except LayoutMismatchError as err:
            transfer._fail(err)
            return transfer
        self._pool.submit(self._pull, transfer, peer, lease_id, list(src_block_ids),
                          list(dst_block_ids), time.monotonic() + timeout_s, heads,
                          tuple(part))
        return transfer

    def _pull(self, transfer: Transfer, peer: Endpoint, lease_id: str, src: list[int],
              dst: list[int], deadline: float, heads: tuple[int, int] | None = None,
              part: tuple[int, int] = (0, 1)) -> None:
        what = f"lease {short(lease_id)} ({len(src)} blocks) from {peer.address}"

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"pulling {what} timed out")
            return left

        try:
            with self._pull_session(peer, remaining) as fields, \
                    self._open(peer, remaining()) as sock:
                transfer._transferring()
                req = PullRequest(
                    op="pull", lease=lease_id, src=src, **fields,
                    heads=list(heads) if heads is not None and heads != peer.layout.heads
                    else None,
                    part=list(part) if part != (0, 1) else None)
                reply = self._request(sock, peer, req, deadline)
                if not dst or heads is None or heads == self.layout.heads == peer.layout.heads:
                    got = self._receive(sock, reply, src, dst, remaining, peer)
                else:
                    got = self._receive_heads(sock, reply, dst, heads, remaining, peer)
                send_msg(sock, Ack(op="ack").wire())
                try:  # the holder has ended the lease once this arrives
                    recv_msg(sock, self.max_frame_bytes)
                except OSError:
                    pass  # our blocks are complete; the holder's lease expires instead
            transfer._succeed(got)
        except TransferError as err:
            transfer._fail(err)
        except TimeoutError:
            transfer._fail(TransferTimeoutError(f"pulling {what} timed out"))
        except (OSError, ValueError) as err:
            transfer._fail(PeerUnreachableError(f"lost {peer.address} during the transfer of "
                                                f"{what}: {err!r}"))
        except Exception as err:  # noqa: BLE001 - never leave a transfer hanging
            transfer._fail(TransferError(f"pulling {what} failed: {err!r}"))

    def _pull_session(self, peer: Endpoint, remaining):
        """Around one pull's connection, request and data phase; yields the fields it adds
        to the request. tcp: nothing (gloo / nccl: one pull at a time on a pair group)."""
        return contextlib.nullcontext({})

    def _receive(self, sock: socket.socket, reply: dict, src: list[int], dst: list[int],
                 remaining, peer: Endpoint) -> int:
        """The data phase, puller side: the peer's `src` blocks straight into our `dst`
        blocks (no staging copy)."""
        return self._receive_heads(sock, reply, dst, self.layout.heads, remaining, peer)

    def _receive_heads(self, sock: socket.socket, reply: dict, dst: list[int],
                       heads: tuple[int, int], remaining, peer: Endpoint) -> int:
        """The data phase for the global `heads` (all of ours, or a subset): straight into
        those heads of `dst`, or through a staging buffer."""
        lo = self.layout.head_start
        local = (heads[0] - lo, heads[1] - lo)
        want = wire_bytes(self.kv_cache, len(dst), local)
        if reply.get("nbytes") != want:
            raise TransferError(f"holder sent {reply.get('nbytes')} bytes, expected {want}")
        if not want:
            return 0
        if self._staging is not None:
            return self._staging.receive(sock, dst, local, remaining, peer.address)
        views = block_views(self.kv_cache, self._cache_bytes, dst, local)
        return recv_views(sock, views, remaining, peer.address)

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            try:  # wakes the accept thread: the port is free once close() returns
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        self.leases.release_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._staging is not None:
            self._staging.close()
