"""Holder-side leases: blocks pinned for a puller until pulled or expired.

Thread-safe (the transport's server threads take and complete leases; the engine loop
drains `released()`). Expiry is checked whenever the table is touched, so the engine only
has to poll; a lease whose blocks are being read does not expire under the reader.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from baton.kv_transfer.base import LeaseExpiredError


@dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    expires: float
    reading: bool = False


class LeaseTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._events: list[tuple[str, str]] = []

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s={ttl_s} must be > 0")
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"a lease for {request_id!r} is already held")
            self._leases[request_id] = Lease(request_id, list(block_ids),
                                             time.monotonic() + ttl_s)

    def take(self, request_id: str, block_ids: list[int] | None = None) -> list[int]:
        """Start reading a lease's blocks (all of them, or the given subset of them)."""
        with self._lock:
            self._expire_locked()
            lease = self._leases.get(request_id)
            if lease is None or lease.reading:
                raise LeaseExpiredError(f"no lease held for {request_id!r} (expired, already "
                                        "pulled, or never offered)")
            if block_ids is not None and not set(block_ids) <= set(lease.block_ids):
                raise LeaseExpiredError(f"blocks {sorted(set(block_ids) - set(lease.block_ids))[:5]}"
                                        f" are not under the lease of {request_id!r}")
            lease.reading = True
            return list(block_ids) if block_ids is not None else list(lease.block_ids)

    def complete(self, request_id: str) -> None:
        """The puller has the bytes: the lease ends ("pulled")."""
        with self._lock:
            if self._leases.pop(request_id, None) is not None:
                self._events.append((request_id, "pulled"))

    def abandon(self, request_id: str) -> None:
        """A read failed: the lease stays held (a retry may come) until it expires."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.reading = False

    def released(self) -> list[tuple[str, str]]:
        with self._lock:
            self._expire_locked()
            events, self._events = self._events, []
            return events

    def release_all(self, reason: str = "closed") -> None:
        with self._lock:
            self._events += [(rid, reason) for rid in self._leases]
            self._leases.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for rid in [r for r, lease in self._leases.items()
                    if lease.expires <= now and not lease.reading]:
            del self._leases[rid]
            self._events.append((rid, "expired"))
