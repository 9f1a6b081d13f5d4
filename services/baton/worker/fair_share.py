"""Fair admission between tenants on one worker. The waiting queue is shared: without this,
one tenant that floods it makes every other tenant's requests a 429 until it drains.

The rule, applied only when the queue is full: a tenant whose requests in flight here
(waiting or running, `Job`s not finished) stay within its share of the queue —
`max_waiting` // the number of tenants with requests in flight, itself included — is
admitted anyway; any other gets the 429. So a flooding tenant is held to the queue it
already has while another tenant is served, a lone tenant sees the plain queue limit, and
the queue overflows by at most `max_waiting` in all (the shares of the others add up to at
most that). Tenants are the router's (`X-Baton-Tenant`, believed only from a caller that
proved the internal token); a request with none is tenant `default`. Event loop only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

DEFAULT_TENANT = "default"


class _Job(Protocol):
    @property
    def request(self) -> _Finishable: ...


class _Finishable(Protocol):
    @property
    def is_finished(self) -> bool: ...


class FairShare:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._jobs: dict[str, list[_Job]] = {}  # tenant -> its admitted jobs, pruned lazily

    def in_flight(self) -> dict[str, int]:
        """Each tenant's unfinished jobs here (finished ones are dropped as they are seen)."""
        for tenant, jobs in list(self._jobs.items()):
            live = [job for job in jobs if not job.request.is_finished]
            if live:
                self._jobs[tenant] = live
            else:
                del self._jobs[tenant]
        return {tenant: len(jobs) for tenant, jobs in self._jobs.items()}

    def share(self, tenant: str) -> int:
        """`tenant`'s share of the queue now (the whole queue when it is alone)."""
        active = set(self.in_flight()) | {tenant}
        return self.max_waiting // len(active)

    def within_share(self, tenant: str, n: int) -> bool:
        """True when `n` more jobs of `tenant` keep it within its share, with another tenant
        in flight (a lone tenant gets no more than the queue)."""
        counts = self.in_flight()
        if not set(counts) - {tenant}:
            return False
        return counts.get(tenant, 0) + n <= self.share(tenant)

    def add(self, tenant: str, jobs: Sequence[_Job]) -> None:
        self._jobs.setdefault(tenant, []).extend(jobs)
