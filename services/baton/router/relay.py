"""One attempt on one upstream, and relaying its answer to the client.

An attempt raises `Retryable` while nothing has reached the client's body yet: connection
refused or reset, a timeout before the response headers or the first chunk, a 5xx, a 408
or a 429 (that worker's queue is full), or a stream that ends before its first byte; the
retry loop (`router.retry`) then moves to another upstream. Once the first bytes are
relayed the stream is committed: a resumable decode stream that breaks raises
`Interrupted` (the retry loop resumes it on another decode pod, `router.resume`); any other
ends with an in-band error event and `[DONE]`. A failure the request itself caused is
final and relayed as is, never retried: a 4xx other than 408 / 429, or a 5xx marked
`X-Baton-No-Retry: 1` (a worker whose engine failed on this request's own settings).
An answer that is not a Baton worker's (`router.answers`: an error that is not OpenAI's
JSON, a 200 without choices, a stream that is not SSE) is the peer's fault, never the
request's: its circuit opens at once and the request moves on (`Retryable`).

Deadlines: `connect_timeout_s` to open a connection, `first_byte_timeout_s` for the response
headers and first chunk, `idle_timeout_s` between chunks, and the request's own deadline
(one timer per attempt, rescheduled per chunk: no task per read). The stream is relayed
chunk by chunk as it arrives, never buffered. If the client goes away, the handler is
cancelled and the upstream connection is closed, which aborts the request on the worker.
Outcomes go to the upstream's circuit breaker (`Discovery.record_success` / `_failure`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web

from baton.common.errors import NO_RETRY_HEADER, OpenAIError
from baton.common.metrics import RouterMetrics
from baton.common.tracing import Tracing
from baton.router.answers import (
    error_problem,
    identity_problem,
    stream_problem,
    whole_problem,
)
from baton.router.discovery import Discovery, Upstream
from baton.router.handover import Handover
from baton.router.resume import StreamTracker
from baton.router.settings import ProxySettings
from baton.router.slo import ClientClock

log = logging.getLogger("baton.router")

def refused_by_request(resp: aiohttp.ClientResponse) -> bool:
    """Whether a worker's error answer is final: the request itself failed (a 4xx other
    than 408 / 429, or a 5xx marked `X-Baton-No-Retry: 1`); any worker would answer it
    the same way."""
    status = resp.status
    if status < 400 or status in (408, 429):
        return False
    return status < 500 or resp.headers.get(NO_RETRY_HEADER) == "1"


class Retryable(Exception):
    """Nothing reached the client's body: another upstream may take the request."""

    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response  # what to answer if no other worker is left


class Interrupted(Exception):
    """A decode pod's stream broke after bytes reached the client; it can be resumed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Send:
    """What one attempt posts: `body` on `path`; `tracker` reads a resumable decode stream;
    `handover` is claimed when the decode pod accepts the body carrying its lease."""

    path: str
    body: bytes
    headers: dict[str, str]
    tracker: StreamTracker | None = None
    handover: Handover | None = None


class EventRewriter(Protocol):
    """Rewrites a relayed stream on its way to the client (`common.responses_format`: chat
    events as Responses events): fed every chunk, cut anywhere, in order."""

    def feed(self, chunk: bytes) -> bytes:
        """What the client gets for `chunk` (possibly nothing yet)."""

    def failed(self, error: OpenAIError) -> bytes:
        """The events that end a stream that broke with `error`."""


class ClientSide:
    """The client's half of one streamed exchange; `clock` times what it is sent (the
    upstream's events, before `rewriter` rewrites them, if it does)."""

    def __init__(self, request: web.Request, clock: ClientClock | None = None,
                 rewriter: EventRewriter | None = None) -> None:
        self.request = request
        self.clock = clock
        self.rewriter = rewriter
        self.out: web.StreamResponse | None = None

    @property
    def gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def start(self) -> None:
        if self.out is None:
            self.out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await self.out.prepare(self.request)

    @property
    def started(self) -> web.StreamResponse:
        """`out`, which exists once `start` sent the 200 (as before any body write)."""
        assert self.out is not None  # start() came first
        return self.out

    async def write(self, chunk: bytes) -> None:
        out = chunk if self.rewriter is None else self.rewriter.feed(chunk)
        if out:
            await self.started.write(out)
        if self.clock is not None:
            self.clock.sent(chunk)

    async def finish_with(self, events: bytes) -> web.StreamResponse:
        return await self._end(events if self.rewriter is None
                               else self.rewriter.feed(events))

    async def fail_in_band(self, error: OpenAIError) -> web.StreamResponse:
        """After the 200 went out, an error can only be an event in the stream."""
        if self.rewriter is not None:
            return await self._end(self.rewriter.failed(error))
        return await self._end(b"data: " + json.dumps(error.body()).encode()
                               + b"\n\n" + b"data: [DONE]\n\n")

    async def _end(self, events: bytes) -> web.StreamResponse:
        out = self.started
        await out.write(events)
        await out.write_eof()
        return out


class Relay:
    def __init__(self, session: aiohttp.ClientSession, discovery: Discovery,
                 metrics: RouterMetrics, tracing: Tracing | None = None) -> None:
        self.session = session
        self.discovery = discovery
        self.metrics = metrics
        self.tracing = tracing or Tracing()

    async def attempt(self, client: ClientSide, ep: Upstream, send: Send, stream: bool,
                      deadline: float, s: ProxySettings) -> web.StreamResponse:
        """One try on one upstream (counted in its `inflight` meanwhile); raises Retryable
        while no body byte reached the client, Interrupted for a resumable stream that
        broke after. For a stream, the client gets its 200 and headers as soon as the
        worker sends its own (so the first token is not held up by header processing);
        the body is still untouched, so a failure before the first byte can move on.
        Traced as a `router.attempt` span, whose context the upstream gets."""
        ep.inflight += 1
        try:
            with self.tracing.span("router.attempt", kind="client", attributes={
                    "baton.upstream": ep.url, "url.path": send.path}) as span:
                self.tracing.inject(send.headers)
                opened = await self._open(client, ep, send, stream, deadline, s)
                span.set("http.response.status_code", opened[0].status)
                if opened[1] is None:
                    return opened[0]  # the whole answer
                resp, first = opened
                try:
                    await self._relay(client, ep, resp, first, deadline, s, send.tracker)
                except BaseException:
                    resp.close()  # drops the connection: the worker aborts the request
                    raise
                resp.release()  # read to the end: the connection goes back to the pool
                return client.started
        finally:
            ep.inflight -= 1

    async def _open(self, client: ClientSide, ep: Upstream, send: Send, stream: bool,
                    deadline: float, s: ProxySettings
                    ) -> tuple[web.Response, None] | tuple[aiohttp.ClientResponse, bytes]:
        """The whole answer (and None), or a stream's upstream response and first bytes."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timer = asyncio.timeout_at(min(t0 + s.first_byte_timeout_s, deadline))
        resp = None
        try:
            async with timer:
                resp = await self.session.post(
                    ep.url + send.path, data=send.body, headers=send.headers,
                    timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s))
                self.metrics.upstream_latency.labels(ep.url).observe(loop.time() - t0)
                self._check(ep, identity_problem(resp.headers, ep.worker_id))
                if resp.status >= 400 and not refused_by_request(resp):
                    raise await self._refused(ep, resp)
                if not stream or resp.status != 200:
                    timer.reschedule(deadline)
                    content = await resp.read()
                    self._check(ep, error_problem(content) if resp.status >= 400
                                else whole_problem(send.path, content))
                    if send.handover is not None and resp.status == 200:
                        send.handover.claim()  # the decode pod has the lease now
                    self.discovery.record_success(ep)
                    return web.Response(body=content, status=resp.status,
                                        content_type=resp.content_type), None
                self._check(ep, stream_problem(resp.content_type, None))
                if send.handover is not None:
                    send.handover.claim()  # the decode pod has the lease now
                await client.start()
                first = await resp.content.readany()
                if not first:
                    raise Retryable("stream ended before its first byte")
                self._check(ep, stream_problem(resp.content_type, first))
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            self.discovery.record_failure(ep)
            phase = "before response headers" if resp is None else "before the first byte"
            raise Retryable(f"{type(err).__name__} {phase}") from None
        finally:
            if resp is not None and (not stream or resp.status != 200):
                resp.release()
        self.discovery.record_success(ep)
        return resp, first

    def _check(self, ep: Upstream, problem: str | None) -> None:
        """Raises Retryable, with `ep`'s circuit opened, when its answer is not a Baton
        worker's (`problem`)."""
        if problem is not None:
            self.discovery.record_misbehaviour(ep, problem)
            raise Retryable("not a Baton answer")

    async def _refused(self, ep: Upstream, resp: aiohttp.ClientResponse) -> Retryable:
        """A 5xx, 408 or 429: retry elsewhere, keeping the answer in case nobody else
        can."""
        content = await resp.read()
        if resp.status >= 500:
            self.discovery.record_failure(ep)
        return Retryable(f"status {resp.status}", web.Response(
            body=content, status=resp.status, content_type=resp.content_type,
            headers={k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}))

    async def _relay(self, client: ClientSide, ep: Upstream, resp: aiohttp.ClientResponse,
                     first: bytes, deadline: float, s: ProxySettings,
                     tracker: StreamTracker | None) -> None:
        out = client.started  # `_open` started the client's stream
        write = client.write if tracker is None else _tracked(client, tracker)
        loop = asyncio.get_running_loop()
        idle = s.idle_timeout_s
        try:
            await write(first)
            async with asyncio.timeout_at(min(loop.time() + idle, deadline)) as timer:
                read = resp.content.readany
                while chunk := await read():
                    await write(chunk)
                    timer.reschedule(min(loop.time() + idle, deadline))
            if tracker is not None and not tracker.finished:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError, TimeoutError) as err:
            if client.gone:
                raise  # the client is gone too; nothing to tell
            if tracker is not None and tracker.can_resume and loop.time() < deadline:
                raise Interrupted(type(err).__name__) from None
            self.metrics.upstream_errors.labels(ep.url, "mid-stream").inc()
            log.warning("worker %s failed mid-stream: %r", ep.url, err)
            await client.fail_in_band(OpenAIError(
                502, f"the worker failed mid-stream: {type(err).__name__}",
                code="upstream_failed"))
            return
        try:
            await out.write_eof()
        except ConnectionResetError:
            pass  # the client left after the last event ([DONE]); nothing is lost


def _tracked(client: ClientSide, tracker: StreamTracker
             ) -> Callable[[bytes], Awaitable[None]]:
    async def write(chunk: bytes) -> None:
        try:
            public = tracker.feed(chunk)
        except ValueError as err:  # a malformed token event: the stream is broken
            raise aiohttp.ClientPayloadError(str(err)) from None
        if public:
            await client.write(public)
    return write
