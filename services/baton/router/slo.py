"""Latency as the client sees it, measured at the router: TTFT, inter-token latency and
end-to-end (`baton:router_*_seconds`, labelled model, decision and tenant).

For a stream, TTFT is the time from the request's arrival to the first event that carries
output (text, a tool call, or a finish reason; the role chunk a stream opens with is not
output), ITL the time between the content chunks relayed after it, E2E the time to the end
of the stream. A non-streamed answer has one time: TTFT = E2E = the time to the whole
answer, and no ITL. Only answers that went out with a 200 are observed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from baton.common.metrics import RouterMetrics

_USAGE = b'"usage"'


class ClientClock:
    """One request's timing, fed by the relay with every chunk the client is sent."""

    __slots__ = ("received", "stream", "usage_tokens", "chunks", "_metrics", "_labels",
                 "_itl", "_first", "_last", "_head")

    def __init__(self, metrics: RouterMetrics, received: float, stream: bool, model: str,
                 decision: str, tenant: str) -> None:
        self.received = received  # time.monotonic() when the request arrived
        self.stream = stream
        self.usage_tokens: int | None = None  # total_tokens of the answer's usage, if any
        self.chunks = 0  # content chunks sent (streams)
        self._metrics = metrics
        self._labels = (model, decision, tenant)
        self._itl = metrics.itl.labels(*self._labels) if stream else None
        self._first: float | None = None
        self._last = 0.0
        self._head = b""  # a stream's bytes until its first output

    def sent(self, chunk: bytes) -> None:
        """`chunk` of a stream went to the client (after the router dropped what it keeps
        to itself); called per chunk on the event loop."""
        now = time.monotonic()
        if self._first is None:
            self._head += chunk
            if not _has_output(self._head):
                return
            self._head = b""
            self._first = now
        else:
            assert self._itl is not None  # set for streams, the only senders of chunks
            self._itl.observe(now - self._last)
        self.chunks += 1
        self._last = now
        if _USAGE in chunk:
            self.usage_tokens = _usage(chunk) or self.usage_tokens

    def finish(self, status: int, body: bytes | None = None) -> None:
        """The request ended with `status` (`body`: a non-streamed answer's)."""
        if status != 200:
            return
        now = time.monotonic()
        if body is not None and _USAGE in body:
            self.usage_tokens = _usage(body)
        first = now if not self.stream else self._first
        if first is None:  # a stream that ended without output (an in-band error)
            return
        self._metrics.ttft.labels(*self._labels).observe(first - self.received)
        self._metrics.e2e.labels(*self._labels).observe(now - self.received)


def _events(data: bytes) -> Iterator[bytes]:
    """The JSON objects of the complete `data:` events in `data` (SSE), or of a body."""
    if not data.startswith((b"data:", b"event:")):
        yield data
        return
    for event in data.split(b"\n\n")[:-1]:  # the last part is incomplete (or empty)
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield line[6:]


def _has_output(data: bytes) -> bool:
    for raw in _events(data):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if (choice.get("text") or choice.get("finish_reason") or delta.get("content")
                    or delta.get("tool_calls") or delta.get("reasoning_content")):
                return True
    return False


def _usage(data: bytes) -> int | None:
    """`usage.total_tokens` of the last event (or body) that reports it."""
    found = None
    for raw in _events(data):
        if _USAGE not in raw:
            continue
        try:
            usage = json.loads(raw).get("usage") or {}
        except (ValueError, AttributeError):
            continue
        total = usage.get("total_tokens")
        if isinstance(total, int):
            found = total
    return found
