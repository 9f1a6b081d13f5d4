"""The retry loop: one OpenAI request, tried on upstreams until one answers.

    response = await forwarder.forward(inbound, ctx, decode, tunables)

Colocated workers get the client's request on its own path; decode pods get the planned
`DecodeCall` on /internal/generate (the first try on the pod it was planned for). An
attempt that fails before the client saw a body byte (`relay.Retryable`) moves to another
upstream, never the same one twice, after a backoff (`backoff_s`, doubled each time), at
most `max_attempts` tries within `request_timeout_s`. A decode stream that breaks after
(`relay.Interrupted`) is resumed on another decode pod with a fresh set of attempts
(`baton:fallbacks_total{reason="decode_lost"}`), or closed when its token budget was
already spent. When nobody is left: the last upstream's own 5xx / 429 answer, else a 502
(a 503 when no upstream could be tried at all), in-band once the stream has started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from baton.common.auth import TENANT_HEADER
from baton.common.errors import OpenAIError
from baton.common.metrics import RouterMetrics
from baton.common.roles import Role
from baton.router.discovery import Discovery, Upstream
from baton.router.relay import (
    ClientSide,
    EventRewriter,
    Interrupted,
    Relay,
    Retryable,
    Send,
)
from baton.router.resume import DecodeCall, StreamTracker
from baton.router.scheduling.context import Phase, RoutingContext
from baton.router.scheduling.pipeline import RoutingPipeline
from baton.router.settings import ProxySettings, Tunables
from baton.router.slo import ClientClock

log = logging.getLogger("baton.router")
GENERATE_PATH = "/internal/generate"


@dataclass(frozen=True)
class Inbound:
    """The client's request as the router received it."""

    http: web.Request
    path: str  # the OpenAI path it came on
    body: bytes
    request_id: str
    stream: bool
    received: float | None = None  # monotonic; for the TTFT breakdown (`X-Baton-Timing`)
    clock: ClientClock | None = None  # times what the client is sent (`router.slo`)
    rewriter: EventRewriter | None = None  # a stream's events as the client gets them


class Forwarder:
    def __init__(self, discovery: Discovery, metrics: RouterMetrics, relay: Relay) -> None:
        self.discovery = discovery
        self.metrics = metrics
        self.relay = relay

    async def forward(self, inbound: Inbound, ctx: RoutingContext, decode: DecodeCall | None,
                      tunables: Tunables) -> web.StreamResponse:
        """The client's response. Raises OpenAIError when no upstream answered and
        nothing was sent to the client yet."""
        s = tunables.proxy
        deadline = asyncio.get_running_loop().time() + s.request_timeout_s
        client = ClientSide(inbound.http, inbound.clock, inbound.rewriter)
        tracker = StreamTracker(decode) if decode is not None and decode.resumable else None
        preferred = decode.preferred if decode is not None else None
        last: Retryable | None = None
        attempt = 0
        while attempt < s.max_attempts:
            ep = _choose(preferred, ctx, tunables.pipeline, self.discovery)
            preferred = None
            if ep is None:
                break
            await self._before(ep, ctx, attempt, deadline, s)
            attempt += 1
            send = _send(ep, inbound, decode, tracker, ctx.tenant)
            try:
                return await self.relay.attempt(client, ep, send, inbound.stream, deadline, s)
            except Retryable as err:
                last, ctx = err, self._failed(ep, ctx, err.reason)
                log.warning("request %s: worker %s failed (%s); %s", inbound.request_id,
                            ep.url, err.reason,
                            "retrying" if attempt < s.max_attempts else "giving up")
            except Interrupted as err:
                ctx = self._failed(ep, ctx, "mid-stream", Phase.RESUME)
                assert tracker is not None  # raised only for a stream that can resume
                if tracker.exhausted:
                    return await client.finish_with(tracker.closing_events())
                tracker.resumes += 1
                attempt = 0  # a fresh set of attempts for the continuation
                self._resuming(ep, err.reason, inbound.request_id, tracker)
                last = Retryable(err.reason)
        return await _give_up(client, last, ctx.model)

    async def _before(self, ep: Upstream, ctx: RoutingContext, attempt: int, deadline: float,
                      s: ProxySettings) -> None:
        """`ep` will hold the prompt's blocks; a retry first waits its backoff."""
        if ctx.prefix_index is not None:
            ctx.prefix_index.add(ep, ctx.prefix_hashes)
        if attempt:
            self.metrics.retries.inc()
            loop = asyncio.get_running_loop()
            await asyncio.sleep(min(s.backoff_s * 2 ** (attempt - 1),
                                    max(deadline - loop.time(), 0)))

    def _failed(self, ep: Upstream, ctx: RoutingContext, reason: str,
                phase: Phase | None = None) -> RoutingContext:
        """Counts the failure; returns the next attempt's context, without `ep` (and, for
        a stream to resume, only decode pods)."""
        if ctx.prefix_index is not None:
            ctx.prefix_index.forget(ep)
        self.metrics.upstream_errors.labels(ep.url, reason).inc()
        return ctx.after_failure(ep, phase)

    def _resuming(self, ep: Upstream, reason: str, request_id: str,
                  tracker: StreamTracker) -> None:
        self.metrics.fallbacks.labels("decode_lost").inc()
        log.warning("request %s: decode pod %s failed mid-stream (%s) after %d tokens; "
                    "resuming on another decode pod", request_id, ep.url, reason,
                    len(tracker.sent))


def _choose(preferred: Upstream | None, ctx: RoutingContext, pipeline: RoutingPipeline,
            discovery: Discovery) -> Upstream | None:
    """The planned decode pod while it is still fit, else the pipeline's pick."""
    if preferred is not None and preferred.healthy and not preferred.circuit_open():
        return preferred
    return pipeline.pick(discovery.all(), ctx)


def _send(ep: Upstream, inbound: Inbound, decode: DecodeCall | None,
          tracker: StreamTracker | None, tenant: str | None = None) -> Send:
    """What `ep` gets: a decode pod the planned (or resumed) GenerateRequest, any other
    upstream the client's own request."""
    headers = {"Content-Type": "application/json", "X-Request-Id": inbound.request_id}
    if tenant is not None:
        headers[TENANT_HEADER] = tenant
    if inbound.received is not None and "X-Baton-Timing" in inbound.http.headers:
        prefill = decode.prefill_s if decode is not None else 0.0
        queued = max(time.monotonic() - inbound.received - prefill, 0.0)
        headers["X-Baton-Timing"] = f"router_queue={queued:.6f},prefill={prefill:.6f}"
    if decode is None or ep.role != Role.DECODE:
        return Send(inbound.path, inbound.body, headers)
    if tracker is not None and tracker.resumes:
        return Send(GENERATE_PATH, tracker.continuation(), headers, tracker)
    return Send(GENERATE_PATH, decode.body(), headers, tracker, decode.handover)


async def _give_up(client: ClientSide, last: Retryable | None,
                   model: str | None) -> web.StreamResponse:
    if last is not None and last.response is not None and client.out is None:
        return last.response
    if last is not None:
        error = OpenAIError(502, f"no worker could serve the request (last error: "
                                 f"{last.reason})", code="upstream_failed")
    else:
        error = OpenAIError(503, f"no healthy worker serves model {model!r}",
                            code="no_worker", headers={"Retry-After": "1"})
    if client.out is None:
        raise error
    return await client.fail_in_band(error)  # 200 and headers already went out
