"""The puller's side of the control plane: connect (the layout check and a hello) and pulls.

A pull returns its `Transfer` at once and runs on a small thread pool: one connection, the
handshake of `handshake.py` and a `pull` request (with the fields the data plane's session
adds), the data plane's receive, then a framed `ack`, after which the holder ends the lease
and confirms. The engine loop polls the Transfer. Nothing the holder sends sizes an
allocation: its frames are bounded, and the data's size follows from the ids and heads we
asked for.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer import handshake
from baton.kv_transfer.base import (
    LayoutMismatchError,
    PeerUnreachableError,
    Transfer,
    TransferError,
    TransferTimeoutError,
    check_pull,
)
from baton.kv_transfer.dataplane import DataPlane, Incoming, Remaining
from baton.kv_transfer.handshake import PullerTerms
from baton.kv_transfer.leases import short
from baton.kv_transfer.messages import Ack, InfoRequest, PullRequest
from baton.kv_transfer.wire import recv_msg, send_msg


class Puller:
    """Pulls into the blocks of a cache of `layout` (`num_blocks` of them) through `plane`,
    at most `max_pulls` at once; `name` is the transport's, in errors."""

    def __init__(self, name: str, terms: PullerTerms, layout: KVLayoutInfo, num_blocks: int,
                 plane: DataPlane, max_pulls: int) -> None:
        self.name, self.terms, self.layout, self.plane = name, terms, layout, plane
        self.num_blocks = num_blocks
        self._connected: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=max_pulls, thread_name_prefix="kv-tcp")

    def open(self, peer: KVEndpointInfo, timeout_s: float) -> socket.socket:
        host, port = peer.address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(timeout_s, 0.001))
        except OSError as err:
            raise PeerUnreachableError(f"cannot reach {peer.engine_id} at {peer.address}: "
                                       f"{err}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def request(self, sock: socket.socket, peer: KVEndpointInfo,
                req: InfoRequest | PullRequest, deadline: float) -> dict[str, Any]:
        """Handshake on `sock` and send `req`; the holder's answer, checked."""
        return handshake.request(sock, self.terms, peer, req, deadline)

    def connect(self, peer: KVEndpointInfo, timeout_s: float) -> None:
        self.check_layout(peer)
        if peer.address in self._connected:
            return
        self.plane.greeted(peer, self.hello(peer, timeout_s))
        self._connected.add(peer.address)

    def check_layout(self, peer: KVEndpointInfo) -> None:
        """Blocks of the same shape (whatever the TP degrees), and some of our heads."""
        why = self.layout.mismatch(peer.layout)
        (a, b), (lo, hi) = peer.layout.heads, self.layout.heads
        if not why and not self.plane.head_subsets and (a, b) != (lo, hi):
            why = f"KV heads [{a}, {b}) vs ours [{lo}, {hi}) ({self.name} moves whole caches)"
        elif not why and not (a < hi and lo < b):
            why = f"it holds KV heads [{a}, {b}), none of ours [{lo}, {hi})"
        if why:
            raise LayoutMismatchError(f"peer {peer.engine_id} has an incompatible KV layout: "
                                      f"{why} (theirs {peer.layout}, ours {self.layout})")

    def hello(self, peer: KVEndpointInfo, timeout_s: float) -> dict[str, Any]:
        """The handshake and an `info` request: the holder's data plane's hello."""
        with self.open(peer, timeout_s) as sock:
            try:
                return self.request(sock, peer, InfoRequest(op="info"),
                                    time.monotonic() + timeout_s)
            except TimeoutError:
                raise TransferTimeoutError(f"handshake with {peer.address} timed out") \
                    from None
            except (OSError, ValueError) as err:
                raise PeerUnreachableError(f"handshake with {peer.address} failed: "
                                           f"{err}") from None

    def pull(self, peer: KVEndpointInfo, lease_id: str, src: list[int], dst: list[int],
             timeout_s: float, heads: tuple[int, int] | None, part: tuple[int, int]
             ) -> Transfer:
        """See `NetworkTransport.pull`."""
        check_pull(self.layout, src, dst, self.num_blocks)
        transfer = Transfer(lease_id, len(dst))
        empty = not src  # a release: no heads move, any rank of the holder
        moved = tuple(heads) if heads is not None else \
            peer.layout.heads if empty else self.layout.heads
        try:
            self._check_heads(peer, (moved[0], moved[1]), empty)
        except LayoutMismatchError as err:
            transfer._fail(err)
            return transfer
        self._pool.submit(self._pull, transfer, peer, lease_id, list(src), list(dst),
                          time.monotonic() + timeout_s, (moved[0], moved[1]),
                          (part[0], part[1]))
        return transfer

    def _check_heads(self, peer: KVEndpointInfo, heads: tuple[int, int], empty: bool) -> None:
        why = self.layout.mismatch(peer.layout)
        if empty and why:
            raise LayoutMismatchError(f"peer {peer.engine_id} has an incompatible KV "
                                      f"layout: {why}")
        if empty:
            return
        self.check_layout(peer)
        (a, b), (lo, hi), (pa, pb) = heads, self.layout.heads, peer.layout.heads
        if not self.plane.head_subsets and heads != (lo, hi):
            raise LayoutMismatchError(f"{self.name} moves whole caches, not KV heads "
                                      f"[{a}, {b}) of our [{lo}, {hi})")
        if not (lo <= a < b <= hi and pa <= a and b <= pb):
            raise LayoutMismatchError(f"KV heads [{a}, {b}) are not held by both peer "
                                      f"{peer.engine_id} [{pa}, {pb}) and us [{lo}, {hi})")

    def _pull(self, transfer: Transfer, peer: KVEndpointInfo, lease_id: str, src: list[int],
              dst: list[int], deadline: float, heads: tuple[int, int],
              part: tuple[int, int]) -> None:
        what = f"lease {short(lease_id)} ({len(src)} blocks) from {peer.address}"

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeoutError(f"pulling {what} timed out")
            return left

        try:
            transfer._succeed(self._session(transfer, peer, lease_id, src, dst, heads, part,
                                            remaining, deadline))
        except TransferError as err:
            transfer._fail(err)
        except TimeoutError:
            transfer._fail(TransferTimeoutError(f"pulling {what} timed out"))
        except (OSError, ValueError) as err:
            transfer._fail(PeerUnreachableError(f"lost {peer.address} during the transfer of "
                                                f"{what}: {err!r}"))
        except Exception as err:  # noqa: BLE001 - never leave a transfer hanging
            transfer._fail(TransferError(f"pulling {what} failed: {err!r}"))

    def _session(self, transfer: Transfer, peer: KVEndpointInfo, lease_id: str,
                 src: list[int], dst: list[int], heads: tuple[int, int],
                 part: tuple[int, int], remaining: Remaining, deadline: float) -> int:
        """One pull's connection: request, data phase, ack; the bytes taken."""
        with self.plane.session(peer, remaining) as fields, \
                self.open(peer, remaining()) as sock:
            transfer._transferring()
            req = PullRequest(
                op="pull", lease=lease_id, src=src, **fields,
                heads=list(heads) if heads != peer.layout.heads else None,
                part=list(part) if part != (0, 1) else None)
            reply = self.request(sock, peer, req, deadline)
            whole = not dst or heads == self.layout.heads == peer.layout.heads
            got = self.plane.receive(Incoming(
                sock, reply, peer, src, dst, self.layout.heads if whole else heads,
                remaining, lambda timeout_s: self.hello(peer, timeout_s)))
            send_msg(sock, Ack(op="ack").wire())
            try:  # the holder has ended the lease once this arrives
                recv_msg(sock, self.terms.max_frame)
            except OSError:
                pass  # our blocks are complete; the holder's lease expires instead
        return got

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
