"""The holder's side of the control plane: the KV port's server.

An accept thread; at most `max_handshakes` connections in their handshake at once, and at
most `max_per_peer` of them from one address (more are closed at once, and counted as
refused), so that one host's silent connections cannot take the slots of every puller; a
connection must send its hello within `handshake.HELLO_TIMEOUT_S` (the whole handshake,
proof included, within the terms' `timeout_s`); a thread per connection. Each connection
carries one request, after the handshake of `handshake.py`: `info` (answered with the data
plane's hello) or `pull` (a lease id and the holder's block ids). For a pull the server
takes the lease's blocks for the authenticated puller, the data plane sends its header and
the bytes (or, when it cannot read the blocks, a refusal instead of the header: the
puller's TransferError), and the puller sends a framed `ack`, on which the lease ends
("pulled") and the server confirms, so a finished Transfer means a released lease. A
connection lost before the ack leaves the lease held (bound to its puller) until it
expires, so that puller's retry can still succeed.

Across tensor-parallel degrees a pull may name `heads`, a range of this rank's KV heads
(only on planes with `head_subsets`), and `part` (i, n): the lease ends when all n of the
puller's ranks reading it have acknowledged.
"""

from __future__ import annotations

import socket
import threading
from collections import deque

from baton.common.internal import KVLayoutInfo
from baton.kv_transfer import handshake
from baton.kv_transfer.base import LeaseExpiredError
from baton.kv_transfer.dataplane import DATA_TIMEOUT_S, DataPlane, DataUnavailable, Outgoing
from baton.kv_transfer.handshake import HolderTerms, Refused
from baton.kv_transfer.leases import LeaseTable
from baton.kv_transfer.messages import InfoRequest, PullRequest
from baton.kv_transfer.wire import recv_msg, send_msg


class HolderServer:
    """Serves pulls of `leases`' blocks through `plane`; refusals go to `refused`. Listens
    from construction, on (host, port) (port 0: any free one); `close()` frees the port."""

    def __init__(self, host: str, port: int, terms: HolderTerms, layout: KVLayoutInfo,
                 plane: DataPlane, leases: LeaseTable, refused: handshake.RefusalLog,
                 max_handshakes: int, max_per_peer: int) -> None:
        self.terms, self.layout, self.plane = terms, layout, plane
        self.leases, self.refused = leases, refused
        self.max_handshakes, self.max_per_peer = max_handshakes, max_per_peer
        # connections in their handshake, oldest first, by peer address
        self._in_handshake: dict[str, deque[socket.socket]] = {}
        self._slots = threading.Lock()
        self._closed = threading.Event()
        self._sock = socket.create_server((host, port), backlog=128)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            full = self._take_slot(addr[0], conn)
            if full:
                conn.close()
                self.refused(f"{addr[0]}: too many connections in their handshake ({full})")
                continue
            threading.Thread(target=self._serve, args=(conn, addr[0]), daemon=True).start()

    def _take_slot(self, ip: str, conn: socket.socket) -> str | None:
        """Take a handshake slot for `conn` from `ip`; None, or which bound is reached. When
        every slot is taken, an address holding at least two more than `ip` gives up its
        oldest (that connection is shut): a flood from many addresses cannot keep a puller
        from another one out."""
        with self._slots:
            held = self._in_handshake.get(ip, deque())
            if len(held) >= self.max_per_peer:
                return f"{self.max_per_peer} from this address"
            if sum(map(len, self._in_handshake.values())) >= self.max_handshakes:
                top = max(self._in_handshake, key=lambda a: len(self._in_handshake[a]))
                if len(self._in_handshake[top]) < len(held) + 2:
                    return f"{self.max_handshakes} in all"
                _shut(self._in_handshake[top].popleft())
                self.refused(f"{top}: a handshake slot given to {ip} (the address holds "
                             f"the most)")
            self._in_handshake.setdefault(ip, held).append(conn)
            return None

    def _release_slot(self, ip: str, conn: socket.socket) -> None:
        with self._slots:
            held = self._in_handshake.get(ip)
            if held is not None and conn in held:
                held.remove(conn)
                if not held:
                    del self._in_handshake[ip]

    def _serve(self, conn: socket.socket, ip: str) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                session = self._accept_session(conn, ip)
            finally:
                self._release_slot(ip, conn)
            if session is None:
                return
            peer, req = session
            conn.settimeout(DATA_TIMEOUT_S)
            try:
                if isinstance(req, InfoRequest):
                    send_msg(conn, self.plane.hello())
                else:
                    self._serve_pull(conn, req, peer)
            except (OSError, ValueError):
                return  # the puller sees the connection drop

    def _accept_session(self, conn: socket.socket, ip: str
                        ) -> tuple[str, InfoRequest | PullRequest] | None:
        """The peer's identity and its request, or None: refused (and logged), or gone."""
        try:
            return handshake.accept(conn, ip, self.terms)
        except Refused as why:
            self.refused(str(why))
        except TimeoutError:
            self.refused(f"{ip}: no handshake within {self.terms.timeout_s} s")
        except OSError:
            pass  # gone before its handshake (a TCP probe, a puller giving up)
        return None

    def _local_heads(self, heads: object) -> tuple[int, int] | None:
        """A pull's global heads as our local [lo, hi), None for all; ValueError if we do
        not hold them all."""
        lo, hi = self.layout.heads
        if heads is None or heads == [lo, hi]:
            return None
        if not (isinstance(heads, list) and len(heads) == 2
                and all(type(h) is int for h in heads) and lo <= heads[0] < heads[1] <= hi
                and self.plane.head_subsets):
            raise ValueError(f"this holder serves KV heads [{lo}, {hi}) whole, not {heads}")
        return heads[0] - lo, heads[1] - lo

    def _serve_pull(self, conn: socket.socket, req: PullRequest, peer: str) -> None:
        """A pull `req` (checked by the handshake: a lease id and block ids in our cache)
        from the authenticated `peer`."""
        part = req.part if req.part is not None else [0, 1]
        try:
            local = self._local_heads(req.heads)
            if not (isinstance(part, list | tuple) and len(part) == 2
                    and all(type(p) is int for p in part) and 0 <= part[0] < part[1] <= 64):
                raise ValueError(f"a malformed part {part!r}")
        except ValueError as err:
            send_msg(conn, {"ok": False, "kind": "layout", "error": str(err)})
            return
        try:
            blocks = self.leases.take(req.lease, req.src, peer, *part)
        except LeaseExpiredError as err:
            send_msg(conn, {"ok": False, "kind": "lease", "error": str(err)})
            return
        acked = False
        try:
            self.plane.send(Outgoing(conn, blocks, local, peer, req))
            acked = recv_msg(conn, self.terms.max_frame).get("op") == "ack"
        except DataUnavailable as err:  # the lease stays held, as for a dropped puller
            send_msg(conn, {"ok": False, "kind": "data", "error": str(err)})
            return
        finally:
            if acked:
                self.leases.complete(req.lease, part[0])
            else:
                self.leases.abandon(req.lease, part[0])
        send_msg(conn, {"ok": True, "released": True})

    def close(self) -> None:
        self._closed.set()
        try:  # wakes the accept thread: the port is free once close() returns
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _shut(conn: socket.socket) -> None:
    """End `conn` from another thread: its serving thread's read fails and it closes."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already gone
