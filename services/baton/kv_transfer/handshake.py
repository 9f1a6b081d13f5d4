"""The KV port's handshake: who may pull from a holder, settled before any lease is looked up.

Every connection to a holder (tcp, gloo / nccl, nixl: they share one control plane)
opens the same way, framed as in `wire.py`:

    puller -> holder   MAGIC, Hello {fingerprint, peer: its id, nonce: Np, auth: whether it
                               has a secret}
    holder -> puller   {"ok": true, "nonce": Nh}        or a refusal (layout, auth mode)
    puller -> holder   the request (InfoRequest | PullRequest {lease, src, ...}), with
                       proof: Pp
    holder -> puller   {"ok": true, "proof": Ph}        or a refusal (wrong proof, request)
    holder -> puller   the request's answer

With a secret, Pp = HMAC-SHA256(secret, "puller" | Np | Nh | puller id | holder id) and Ph
the same with "holder": each side proves the key over both fresh nonces and both ids, so a
proof can be neither replayed nor reflected; the holder checks the puller before it looks
up a lease, the puller checks the holder before it takes a byte into its cache. Without a
secret (a local cluster) nothing is proved; a holder with a secret refuses a puller without
one, and a puller with one refuses a holder without.

The holder gives a connection `HELLO_TIMEOUT_S` (at most `timeout_s`) for its first bytes,
the magic and the hello, and `timeout_s` for all of it: a silent connection holds a
handshake slot for a second, not the whole deadline. A peer that is silent, slow or speaks
anything else is disconnected, and logged at most once a second (a flood of junk
costs one line a second, with the count of the rest). The messages are typed in
`messages.py`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from pydantic import ValidationError

from baton.common.internal import KVEndpointInfo
from baton.kv_transfer.base import (
    KVAuthError,
    LayoutMismatchError,
    LeaseExpiredError,
    TransferError,
)
from baton.kv_transfer.messages import (
    NONCE_PATTERN,
    REQUEST,
    Hello,
    InfoRequest,
    PullRequest,
)
from baton.kv_transfer.wire import MAGIC, FrameError, recv_magic, recv_msg, send_msg

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
HELLO_TIMEOUT_S = 1.0  # a puller sends its hello as soon as it connects
_NONCE = re.compile(NONCE_PATTERN)
_ERRORS = {"layout": LayoutMismatchError, "lease": LeaseExpiredError, "auth": KVAuthError}


class Refused(Exception):
    """The holder refused a connection; str() is the reason it logs."""


@dataclass(frozen=True)
class HolderTerms:
    engine_id: str
    layout: str  # what a puller with another layout is told
    fingerprint: str
    num_blocks: int
    secret: str | None
    timeout_s: float
    max_frame: int


@dataclass(frozen=True)
class PullerTerms:
    engine_id: str
    fingerprint: str
    secret: str | None
    max_frame: int


def proof(secret: str, role: str, puller_nonce: str, holder_nonce: str, puller_id: str,
          holder_id: str) -> str:
    parts = (b"baton-kv-2", role, puller_nonce, holder_nonce, puller_id, holder_id)
    msg = b"".join(len(p).to_bytes(4, "big") + p
                   for p in (x if isinstance(x, bytes) else x.encode() for x in parts))
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def proof_ok(given: object, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def check_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """The holder's answer, or its refusal raised as the typed TransferError it names."""
    if reply.get("ok") is not True:
        raise _ERRORS.get(str(reply.get("kind")), TransferError)(str(reply.get("error", "refused")))
    return reply


# -- holder --------------------------------------------------------------------------------
def accept(conn: socket.socket, ip: str, terms: HolderTerms
           ) -> tuple[str, InfoRequest | PullRequest]:
    """Run the handshake on a fresh connection. Returns the peer's identity ("<id>@<ip>",
    which leases are bound to) and its request, validated. Raises Refused (after telling a
    peer that speaks our protocol why), TimeoutError past the deadline, OSError."""
    start = time.monotonic()
    deadline = start + terms.timeout_s
    hello_by = start + min(HELLO_TIMEOUT_S, terms.timeout_s)
    try:
        recv_magic(conn, hello_by)
        hello = recv_msg(conn, terms.max_frame, hello_by)
        puller, their_nonce = _check_hello(conn, ip, hello, terms)
        my_nonce = secrets.token_hex(16) if terms.secret else None
        send_msg(conn, {"ok": True, "nonce": my_nonce} if my_nonce else {"ok": True})
        raw = recv_msg(conn, terms.max_frame, deadline)
    except FrameError as err:
        raise Refused(str(err)) from None
    who = f"{puller}@{ip}"
    welcome: dict[str, Any] = {"ok": True}
    if terms.secret:  # before the request is read: a wrong key learns nothing more
        assert my_nonce is not None  # made above whenever there is a secret
        ids = (their_nonce, my_nonce, puller, terms.engine_id)
        given = raw.get("proof") if isinstance(raw, dict) else None
        if not proof_ok(given, proof(terms.secret, "puller", *ids)):
            _refuse(conn, "auth", f"holder {terms.engine_id} refused our KV secret: the "
                    "secrets differ", f"{who}: wrong KV secret")
        welcome["proof"] = proof(terms.secret, "holder", *ids)
    request = _check_request(conn, who, raw, terms)
    send_msg(conn, welcome)
    return who, request


def _refuse(conn: socket.socket, kind: str, told: str, logged: str) -> NoReturn:
    try:
        send_msg(conn, {"ok": False, "kind": kind, "error": told})
    except OSError:
        pass
    raise Refused(logged)


def _check_hello(conn: socket.socket, ip: str, raw: object, terms: HolderTerms
                 ) -> tuple[str, str]:
    try:
        hello = Hello.model_validate(raw)
    except ValidationError:
        _refuse(conn, "proto", "a malformed hello", f"{ip}: a malformed hello")
    puller, nonce = hello.peer, hello.nonce
    if hello.fingerprint != terms.fingerprint:
        _refuse(conn, "layout", f"layout mismatch: holder has {terms.layout}",
                f"{puller}@{ip}: another KV layout")
    if terms.secret and not hello.auth:
        _refuse(conn, "auth", f"holder {terms.engine_id} requires the KV secret (the "
                "internal token) and this puller has none", f"{puller}@{ip}: no KV secret")
    if not terms.secret and hello.auth:
        _refuse(conn, "auth", f"holder {terms.engine_id} has no KV secret and this puller "
                "has one: configure the same internal token on both",
                f"{puller}@{ip}: has a KV secret, this holder none")
    return puller, nonce


def _check_request(conn: socket.socket, who: str, raw: object, terms: HolderTerms
                   ) -> InfoRequest | PullRequest:
    try:
        req = REQUEST.validate_python(raw)
    except ValidationError:
        _refuse(conn, "proto", "a malformed request", f"{who}: a malformed request")
    if isinstance(req, InfoRequest):
        return req
    if len(req.src) > terms.num_blocks:
        _refuse(conn, "proto", "a malformed request", f"{who}: a malformed request")
    if not all(type(b) is int and 0 <= b < terms.num_blocks for b in req.src):
        _refuse(conn, "lease", f"block ids outside [0, {terms.num_blocks})",
                f"{who}: block ids out of range")
    return req


class RefusalLog:
    """Logs refused connections, at most one line per `interval_s`; counts them all."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.total = 0
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._quiet = 0

    def __call__(self, reason: str) -> None:
        with self._lock:  # logging under the lock: `total` never runs ahead of the log
            self.total += 1
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._quiet += 1
                return
            quiet, self._quiet, self._last = self._quiet, 0, now
            more = f" ({quiet} more refused since the last line)" if quiet else ""
            log.warning("KV port: refused a connection: %s%s", reason, more)


# -- puller --------------------------------------------------------------------------------
def request(sock: socket.socket, terms: PullerTerms, peer: KVEndpointInfo,
            req: InfoRequest | PullRequest, deadline: float) -> dict[str, Any]:
    """Handshake with the holder `peer` on a fresh connection, send `req` and return the
    holder's answer to it. Raises the holder's refusal as a typed TransferError
    (KVAuthError when the secrets disagree), TimeoutError past `deadline`, OSError or
    ValueError (FrameError) when the connection breaks."""
    nonce = secrets.token_hex(16)
    hello = Hello(op="hello", fingerprint=terms.fingerprint, peer=terms.engine_id, nonce=nonce,
                  auth=terms.secret is not None)
    send_msg(sock, hello.wire(), prefix=MAGIC)
    theirs = check_reply(recv_msg(sock, terms.max_frame, deadline)).get("nonce")
    where = f"holder {peer.engine_id} at {peer.address}"
    if terms.secret and not (isinstance(theirs, str) and _NONCE.fullmatch(theirs)):
        raise KVAuthError(f"{where} has no KV secret and this engine has one: configure the "
                          "same internal token on both")
    if not terms.secret and theirs is not None:
        raise KVAuthError(f"{where} requires a KV secret and this engine has none")
    ids = (nonce, str(theirs), terms.engine_id, peer.engine_id)  # theirs: checked above
    if terms.secret:
        req = req.model_copy(update={"proof": proof(terms.secret, "puller", *ids)})
    send_msg(sock, req.wire())
    welcome = check_reply(recv_msg(sock, terms.max_frame, deadline))
    if terms.secret and not proof_ok(welcome.get("proof"), proof(terms.secret, "holder", *ids)):
        raise KVAuthError(f"{where} could not prove the KV secret: the secrets differ")
    return check_reply(recv_msg(sock, terms.max_frame, deadline))
