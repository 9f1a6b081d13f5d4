"""Holder-side leases: blocks pinned for a puller until pulled or expired.

A lease's id is random (`secrets.token_urlsafe`, 192 bits) and never derived from the
request id, so only the puller it was handed to can name it; the first peer that claims it
(`take`) owns it, and any other peer presenting the same id is refused: it can neither read
nor release the blocks. Requests stay the engine's key: `released()` reports request ids.

Thread-safe (the transport's server threads take and complete leases; the engine loop
drains `released()`). Expiry is checked whenever the table is touched, so the engine only
has to poll; a lease whose blocks are being read does not expire under the reader.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from baton.kv_transfer.base import LeaseExpiredError

LEASE_ID_BYTES = 24  # 192 bits, 32 url-safe characters


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    expires: float
    reading: set[int] = field(default_factory=set)  # the parts being read now
    peer: str | None = None  # the puller that claimed it first; only it may read it
    shares: int = 1  # the puller's ranks that each read a part (their heads): TP N -> M
    done: set[int] = field(default_factory=set)  # the parts read and acknowledged


def short(lease_id: str) -> str:
    """A lease id as errors and logs show it: enough to correlate, too little to use."""
    return f"{lease_id[:6]}…"


class LeaseTable:
    def __init__(self, num_blocks: int | None = None) -> None:
        self.num_blocks = num_blocks  # the cache's blocks: held ids must be below it
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}  # lease id -> lease
        self._held: set[str] = set()  # request ids under a lease
        self._events: list[tuple[str, str]] = []

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float,
             lease_id: str | None = None) -> str:
        """Pin `block_ids` for `ttl_s` seconds; returns the new lease's id (`lease_id`: a
        tensor-parallel follower rank's copy of the lease rank 0 made)."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s={ttl_s} must be > 0")
        if self.num_blocks is not None and any(not 0 <= b < self.num_blocks
                                               for b in block_ids):
            raise ValueError(f"blocks of {request_id!r} outside [0, {self.num_blocks})")
        lease_id = lease_id or secrets.token_urlsafe(LEASE_ID_BYTES)
        with self._lock:
            if request_id in self._held or lease_id in self._leases:
                raise ValueError(f"a lease for {request_id!r} is already held")
            self._held.add(request_id)
            self._leases[lease_id] = Lease(request_id, list(block_ids),
                                           time.monotonic() + ttl_s)
        return lease_id

    def take(self, lease_id: str, block_ids: list[int], peer: str, part: int = 0,
             shares: int = 1) -> list[int]:
        """Start reading `block_ids` of a lease on behalf of `peer`, which claims the lease
        if nobody has. A puller of another TP degree reads it in `shares` parts (one per
        rank, the same peer id), the lease ending when every part is acknowledged. Raises
        LeaseExpiredError when the lease (part) is gone, being read, owned by another peer,
        or does not cover the blocks (each at most once)."""
        with self._lock:
            self._expire_locked()
            lease = self._leases.get(lease_id)
            if lease is not None and (lease.peer is not None and shares != lease.shares
                                      or not 0 <= part < shares):
                raise LeaseExpiredError(f"lease {short(lease_id)}: part {part} of {shares} "
                                        f"does not match its {lease.shares} parts")
            if lease is None or part in lease.reading or part in lease.done:
                raise LeaseExpiredError(f"no lease {short(lease_id)} held (expired, already "
                                        "pulled, being pulled, or never offered)")
            if lease.peer is not None and lease.peer != peer:
                raise LeaseExpiredError(f"lease {short(lease_id)} was claimed by another "
                                        "puller")
            covered = set(lease.block_ids)
            if len(set(block_ids)) != len(block_ids) or not set(block_ids) <= covered:
                raise LeaseExpiredError(f"blocks {sorted(set(block_ids) - covered)[:5]} are "
                                        f"not under lease {short(lease_id)}, or repeated")
            lease.peer, lease.shares = peer, shares
            lease.reading.add(part)
            return list(block_ids)

    def complete(self, lease_id: str, part: int = 0) -> None:
        """The puller has the bytes (of every part): the lease ends ("pulled")."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return
            lease.reading.discard(part)
            lease.done.add(part)
            if len(lease.done) >= lease.shares:
                self._end_locked(self._leases.pop(lease_id), "pulled")

    def abandon(self, lease_id: str, part: int = 0) -> None:
        """A read failed: the lease stays held (its owner may retry) until it expires."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.reading.discard(part)

    def release(self, lease_id: str) -> bool:
        """The holder's own call (nobody will pull it): end the lease now ("released").
        False when it is not held, or is being read (that read ends it, or its failure
        leaves it to expire)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.reading:
                return False
            self._end_locked(self._leases.pop(lease_id), "released")
            return True

    def released(self) -> list[tuple[str, str]]:
        """(request id, "pulled" | "expired" | "released" | "closed") for leases ended
        since the last call, each once."""
        with self._lock:
            self._expire_locked()
            events, self._events = self._events, []
            return events

    def release_all(self, reason: str = "closed") -> None:
        with self._lock:
            for lease in self._leases.values():
                self._end_locked(lease, reason)
            self._leases.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _end_locked(self, lease: Lease, reason: str) -> None:
        self._held.discard(lease.request_id)
        self._events.append((lease.request_id, reason))

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for lid in [lid for lid, lease in self._leases.items()
                    if lease.expires <= now and not lease.reading]:
            self._end_locked(self._leases.pop(lid), "expired")
