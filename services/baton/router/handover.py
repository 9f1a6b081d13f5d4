"""A prefilled KV lease between its prefill pod and the decode pod that takes it over.

When a remote prefill succeeds, its pod holds the prompt's blocks under a lease until a
decode pod pulls them (or `lease_ttl_s` runs out). A decode pod that answered the
`GenerateRequest` carrying the lease has taken it over (it pulls it, or releases it when its
request ends first). If the request leaves the router before any decode pod did — the
client went away between the prefill and the decode call, or no decode pod would take it —
the router tells the prefill pod to free the blocks now: `POST /internal/release` with
`{"lease_id": ...}` (answered 200 `{"released": bool}`), best effort, in the background,
bounded by a short timeout (`baton:router_kv_releases_total{result}`: `released`,
`not_held` when the lease had ended already, `failed`, or `status <code>`).
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from baton.common.internal import KVTransferParams, ReleaseRequest
from baton.common.metrics import RouterMetrics
from baton.common.tracing import Tracing
from baton.router.discovery import Upstream

log = logging.getLogger("baton.router")
RELEASE_PATH = "/internal/release"
RELEASE_TIMEOUT_S = 2.0


class Handover:
    """One lease on its way to a decode pod; `claim` once a decode pod has it."""

    __slots__ = ("params", "holder", "claimed")

    def __init__(self, params: KVTransferParams, holder: Upstream) -> None:
        self.params = params
        self.holder = holder  # the prefill pod
        self.claimed = False

    def claim(self) -> None:
        self.claimed = True


class Releaser:
    """Releases the leases of requests that ended unclaimed; tasks on the event loop."""

    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics,
                 tracing: Tracing, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        self.session = session
        self.metrics = metrics
        self.tracing = tracing
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def release_unclaimed(self, handover: Handover | None, request_id: str) -> None:
        """Starts the release of `handover`'s lease unless a decode pod claimed it. Never
        blocks (safe in a cancelled handler's `finally`)."""
        if handover is None or handover.claimed:
            return
        task = asyncio.get_running_loop().create_task(self._post(handover, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, handover: Handover, request_id: str) -> None:
        pod, lease = handover.holder, handover.params.lease_id
        headers = self.tracing.inject({"Content-Type": "application/json",
                                       "X-Request-Id": request_id + "-release"})
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.post(pod.url + RELEASE_PATH, headers=headers,
                                             data=ReleaseRequest(lease_id=lease).model_dump_json()) as resp:
                    answer = await resp.read()
            result = _result(resp.status, answer)
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            result = "failed"
            log.warning("request %s: releasing lease %s on %s failed (%r); it expires "
                        "after %gs", request_id, lease, pod.url, err,
                        handover.params.lease_ttl_s)
        self.metrics.kv_releases.labels(result).inc()

    async def close(self) -> None:
        """Waits for the releases under way (each bounded by the timeout)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _result(status: int, answer: bytes) -> str:
    """`released`, `not_held` (pulled or expired already), or `status <code>`."""
    if status != 200:
        return f"status {status}"
    try:
        released = json.loads(answer).get("released")
    except (ValueError, AttributeError):
        released = None
    return "released" if released else "not_held"
