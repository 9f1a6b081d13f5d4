"""A deadline on reading each request's head (request line + headers), for both servers.

Neither aiohttp's server (the router) nor uvicorn's httptools protocol (the workers) bounds
the time a client may take to send a request head: a slowloris client that opens
connections and dribbles header bytes holds them open. Here a connection whose head is not
complete `timeout_s` after it started is closed. A head starts when the connection opens,
and on a kept-alive connection with the first byte after the previous request's body;
idle kept-alive connections are left to the servers' keep-alive timeouts, and a slow
request body is not a slow head.

    factory = aiohttp_protocols(runner.server, 10.0, on_timeout)  # loop.create_server(factory, …)
    uvicorn.run(app, http=httptools_protocol(10.0), …)

Each adapter feeds one `HeadDeadline` from its parser's own view of message boundaries
(uvicorn: httptools' `on_message_begin` / `on_headers_complete`; aiohttp: the messages its
parser queues and their payloads' end), so the guard never parses HTTP itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp.streams import StreamReader
    from aiohttp.web_protocol import RequestHandler
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0


class HeadDeadline:
    """One connection's timer: `arm` when a head starts (no-op while armed), `disarm` when
    it is complete; expiry closes the transport and calls `on_timeout`."""

    __slots__ = ("_loop", "_timeout_s", "_transport", "_on_timeout", "_handle")

    def __init__(self, transport: asyncio.BaseTransport, timeout_s: float,
                 on_timeout: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self._transport = transport
        self._on_timeout = on_timeout
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self) -> None:
        if self._handle is None:
            self._handle = self._loop.call_later(self._timeout_s, self._expire)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        if not self._transport.is_closing():
            self._transport.close()
            if self._on_timeout is not None:
                self._on_timeout()


# -- aiohttp (the router) ----------------------------------------------------------------
class _AiohttpHeadGuard(asyncio.Protocol):
    """Wraps one aiohttp `RequestHandler`: the event loop talks to this, this to it. A
    head is complete when the handler's parser queues a message; bytes that arrive while
    the last message's body is incomplete are body, any others start the next head."""

    def __init__(self, inner: RequestHandler, timeout_s: float,
                 on_timeout: Callable[[], None] | None) -> None:
        self.inner = inner
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._deadline: HeadDeadline | None = None
        self._body: StreamReader | None = None  # the last message's payload

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        self._deadline = HeadDeadline(transport, self._timeout_s, self._on_timeout)
        self._deadline.arm()

    def data_received(self, data: bytes) -> None:
        assert self._deadline is not None  # the loop calls connection_made first
        if self._body is None or self._body.is_eof():
            self._deadline.arm()
        messages = self.inner._messages  # aiohttp's queue of parsed (message, payload)
        queued = len(messages)
        self.inner.data_received(data)
        if len(messages) > queued:  # one or more heads completed in this chunk
            self._deadline.disarm()
            self._body = messages[-1][1]

    def eof_received(self) -> bool | None:
        inner: asyncio.Protocol = self.inner  # its answer as asyncio types it
        return inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def aiohttp_protocols(server: Callable[[], RequestHandler], timeout_s: float,
                      on_timeout: Callable[[], None] | None = None
                      ) -> Callable[[], asyncio.Protocol]:
    """A protocol factory for `loop.create_server`: `server` (an aiohttp `web.Server`, e.g.
    `AppRunner.server`) behind the head deadline."""
    return lambda: _AiohttpHeadGuard(server(), timeout_s, on_timeout)


# -- uvicorn's httptools protocol (the workers) ------------------------------------------
def httptools_protocol(timeout_s: float = HEADER_TIMEOUT_S,
                       on_timeout: Callable[[], None] | None = None
                       ) -> type[HttpToolsProtocol]:
    """uvicorn's `HttpToolsProtocol` with the head deadline, for `uvicorn.run(http=…)`."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        # uvicorn's own override narrows the transport the same way (a stream server's)
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.head_deadline = HeadDeadline(transport, timeout_s, on_timeout)
            self.head_deadline.arm()

        def on_message_begin(self) -> None:  # a head's first byte (kept-alive connections)
            super().on_message_begin()
            self.head_deadline.arm()

        def on_headers_complete(self) -> None:
            self.head_deadline.disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self.head_deadline.disarm()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol
