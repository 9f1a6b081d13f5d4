"""Relaying one OpenAI request to a worker, with retries and deadlines.

An attempt fails over to another worker (never the same one twice) when nothing has reached
the client yet: connection refused or reset, a timeout before the response headers, a 5xx,
a 429 (that worker's queue is full), or a stream that ends before its first byte. Once the
first bytes are relayed the stream is committed: an upstream failure after that ends it with
an in-band error event and `[DONE]`. A 4xx other than 429 is the client's error and is
relayed as is.

Deadlines: `connect_timeout_s` to open a connection, `first_byte_timeout_s` for the response
headers and first chunk, `idle_timeout_s` between chunks, and `request_timeout_s` for the
whole request. The stream is relayed chunk by chunk as it arrives, never buffered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from baton.common.errors import OpenAIError
from baton.common.metrics import RouterMetrics
from baton.router.discovery import Endpoint, StaticDiscovery
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.pipeline import RoutingPipeline

log = logging.getLogger("baton.router")


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3
    backoff_s: float = 0.05  # doubled after each failed attempt
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"ProxySettings.max_attempts={self.max_attempts} must be >= 1")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
                     "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProxySettings.{name} must be > 0")


class _Retryable(Exception):
    def __init__(self, reason: str, response: Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response  # what to answer if no other worker is left


class Proxy:
    def __init__(self, session: aiohttp.ClientSession, discovery: StaticDiscovery,
                 pipeline: RoutingPipeline, metrics: RouterMetrics,
                 settings: ProxySettings) -> None:
        self.session = session
        self.discovery = discovery
        self.pipeline = pipeline
        self.metrics = metrics
        self.settings = settings

    async def forward(self, path: str, body: bytes, request_id: str, model: str,
                      stream: bool) -> Response:
        s = self.settings
        deadline = time.monotonic() + s.request_timeout_s
        ctx = RoutingContext(model=model)
        last: _Retryable | None = None
        for attempt in range(s.max_attempts):
            ep = self.pipeline.pick(self.discovery.all(), ctx)
            if ep is None:
                break
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(min(s.backoff_s * 2 ** (attempt - 1),
                                        max(deadline - time.monotonic(), 0)))
            ep.inflight += 1
            try:
                return await self._attempt(ep, path, body, request_id, stream, deadline)
            except _Retryable as err:
                ep.inflight -= 1
                last = err
                ctx.tried.add(ep.url)
                self.metrics.upstream_errors.labels(ep.url, err.reason).inc()
                log.warning("request %s: worker %s failed (%s); %s", request_id, ep.url,
                            err.reason, "retrying" if attempt + 1 < s.max_attempts
                            else "giving up")
            except BaseException:
                ep.inflight -= 1
                raise
        if last is not None and last.response is not None:
            return last.response
        if last is not None:
            raise OpenAIError(502, f"no worker could serve the request (last error: "
                                   f"{last.reason})", code="upstream_failed")
        raise OpenAIError(503, f"no healthy worker serves model {model!r}",
                          code="no_worker", headers={"Retry-After": "1"})

    async def _attempt(self, ep: Endpoint, path: str, body: bytes, request_id: str,
                       stream: bool, deadline: float) -> Response:
        """One try on one worker; raises _Retryable while nothing reached the client.
        On success the returned response owns `ep.inflight` (released when it ends)."""
        s = self.settings
        t0 = time.monotonic()
        first_byte = min(s.first_byte_timeout_s, deadline - t0)
        timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s,
                                        sock_read=None)
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        try:
            resp = await asyncio.wait_for(self.session.post(
                ep.url + path, data=body, headers=headers, timeout=timeout), first_byte)
        except (aiohttp.ClientError, OSError) as err:
            self.discovery.record_failure(ep)
            raise _Retryable(f"connect: {type(err).__name__}") from None
        except TimeoutError:
            self.discovery.record_failure(ep)
            raise _Retryable("timeout before response headers") from None
        self.metrics.upstream_latency.labels(ep.url).observe(time.monotonic() - t0)
        try:
            if resp.status >= 500 or resp.status == 429:
                content = await resp.read()
                if resp.status >= 500:
                    self.discovery.record_failure(ep)
                relay = Response(content, resp.status, media_type=resp.content_type,
                                 headers=_passthrough(resp.headers))
                raise _Retryable(f"status {resp.status}", relay)
            if not stream or resp.status != 200:
                content = await asyncio.wait_for(resp.read(), deadline - time.monotonic())
                self.discovery.record_success(ep)
                ep.inflight -= 1
                return Response(content, resp.status, media_type=resp.content_type)
            first = await asyncio.wait_for(resp.content.readany(),
                                           min(s.first_byte_timeout_s,
                                               deadline - time.monotonic()))
            if not first:
                raise _Retryable("stream ended before its first byte")
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            resp.close()
            self.discovery.record_failure(ep)
            raise _Retryable(f"read: {type(err).__name__}") from None
        except BaseException:
            resp.close()
            raise
        self.discovery.record_success(ep)
        return StreamingResponse(self._relay(ep, resp, first, deadline),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(self._release, ep, resp))

    async def _relay(self, ep: Endpoint, resp: aiohttp.ClientResponse, first: bytes,
                     deadline: float) -> AsyncIterator[bytes]:
        yield first
        try:
            while True:
                budget = min(self.settings.idle_timeout_s, deadline - time.monotonic())
                chunk = await asyncio.wait_for(resp.content.readany(), max(budget, 0.001))
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            self.metrics.upstream_errors.labels(ep.url, "mid-stream").inc()
            log.warning("worker %s failed mid-stream: %r", ep.url, err)
            error = OpenAIError(502, f"the worker failed mid-stream: {type(err).__name__}",
                                code="upstream_failed")
            yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

    @staticmethod
    def _release(ep: Endpoint, resp: aiohttp.ClientResponse) -> None:
        """After the response ended, for whatever reason: closing an unfinished upstream
        response drops its connection, which makes the worker abort the request."""
        ep.inflight -= 1
        resp.close()


def _passthrough(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "retry-after"}
