"""OpenTelemetry tracing for the services: one `Tracing` object per process, off by default.

    tracing = setup_tracing("baton-router", settings.otlp_endpoint)   # None: off
    with tracing.span("router.request", headers=request.headers) as span:   # the caller's
        span.set("baton.model", model)                                       # traceparent
        with tracing.span("router.prefill", kind="client"):
            headers = tracing.inject({"X-Request-Id": rid})   # + traceparent of this span
    queue = tracing.start("worker.queue")       # a span ended elsewhere (a callback) ...
    queue.end()                                  # ... or `end(end_ns=...)` after the fact

Spans are exported over OTLP/HTTP (protobuf, batched) to `endpoint`; propagation is W3C
Trace Context (`traceparent`, `tracestate`) in and out. Nothing global is set: the tracer
provider lives in the `Tracing` object (several services can share a test process), and the
current span is the OpenTelemetry context of the running task (contextvars: it follows
`await`, and a task started inside a span inherits it).

Off (no endpoint), `Tracing` imports nothing from OpenTelemetry and every call returns at
once: `span()` is one shared no-op context manager, `inject()` returns its argument.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from contextvars import Token

    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span as OTelSpan
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACES_PATH = "/v1/traces"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"  # a collector's base URL: /v1/traces appended
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # the traces URL, as is
Kind = Literal["server", "client", "internal"]
Attributes = Mapping[str, str | int | float | bool]


def otlp_endpoint(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL: the flag (a collector's base URL, e.g.
    http://otel-collector:4318; `/v1/traces` is appended unless given), else
    $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else $OTEL_EXPORTER_OTLP_ENDPOINT +
    `/v1/traces`; None (tracing off) when none is set. Raises ValueError for a URL that is
    not http(s)."""
    url = environ.get(TRACES_ENDPOINT_ENV) or None
    base = flag or (None if url else environ.get(ENDPOINT_ENV) or None)
    given = base or url
    if given is not None and not given.startswith(("http://", "https://")):
        raise ValueError(f"the OTLP endpoint {given!r} is not an http(s) URL "
                         f"(--otlp-endpoint, ${ENDPOINT_ENV}, ${TRACES_ENDPOINT_ENV}; "
                         "OTLP over HTTP only)")
    if base is not None:
        base = base.rstrip("/")
        url = base if base.endswith(TRACES_PATH) else base + TRACES_PATH
    return url


def setup_tracing(service_name: str, endpoint: str | None = None, *,
                  exporter: Any = None) -> Tracing:
    """The process's `Tracing`: spans batched to `endpoint` (OTLP/HTTP), or handed to
    `exporter` one by one as they end (tests: an `InMemorySpanExporter`); with neither,
    the no-op `Tracing` (nothing imported, nothing recorded)."""
    if endpoint is None and exporter is None:
        return Tracing()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider)


class Span:
    """A started span (a thin handle on OpenTelemetry's): attributes, events, an error
    status, and `end`. Ending twice is harmless."""

    __slots__ = ("raw",)

    def __init__(self, raw: OTelSpan) -> None:
        self.raw = raw

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.raw.set_attribute(key, value)

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """A point in time inside the span (e.g. `first_token`)."""
        self.raw.add_event(name, attributes)

    def error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.raw.set_status(Status(StatusCode.ERROR, description))

    def end(self, end_ns: int | None = None) -> None:
        """End now, or at `end_ns` (nanoseconds since the epoch, `time.time_ns()`)."""
        self.raw.end(end_ns)


class _NoSpan(Span):
    """What every call returns while tracing is off."""

    __slots__ = ()

    def set(self, key: str, value: str | int | float | bool) -> None:
        pass

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        pass

    def error(self, description: str) -> None:
        pass

    def end(self, end_ns: int | None = None) -> None:
        pass

    def __enter__(self) -> Span:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


# No OpenTelemetry span behind it (tracing off imports none): `raw` is None.
NO_SPAN = _NoSpan(cast("OTelSpan", None))


class Tracing:
    """Starts spans and carries their context across HTTP calls. Used on the event loop
    (or any one thread per span); built by `setup_tracing`."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("baton") if provider is not None else None
        self._propagator: TraceContextTextMapPropagator | None = None
        if provider is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, *, headers: Mapping[str, str] | None = None,
              parent: Span | None = None, attributes: Attributes | None = None,
              kind: Kind | None = None, start_ns: int | None = None) -> Span:
        """A started span that is not made current: the caller ends it. Its parent is
        `parent`, else the trace context of `headers` (an incoming request: kind `server`,
        a new trace when it carries none), else the current span (or a new trace)."""
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry import trace

        if parent is not None:
            context = trace.set_span_in_context(parent.raw)
        elif headers is not None:
            assert self._propagator is not None  # set with the tracer
            context = self._propagator.extract(headers)
            kind = kind or "server"
        else:
            context = None
        return Span(self._tracer.start_span(
            name, context, kind=_KINDS[kind or "internal"](), attributes=attributes,
            start_time=start_ns))

    def span(self, name: str, *, headers: Mapping[str, str] | None = None,
             parent: Span | None = None, attributes: Attributes | None = None,
             kind: Kind | None = None) -> _Current | _NoSpan:
        """`start`, as a context manager: the span is current inside the block (children
        and `inject` use it) and ends at its exit; an exception leaving the block marks it
        an error (`cancelled` set when the task was cancelled: a client that left)."""
        if self._tracer is None:
            return NO_SPAN
        return _Current(self.start(name, headers=headers, parent=parent,
                                   attributes=attributes, kind=kind))

    def inject(self, headers: MutableMapping[str, str],
               span: Span | None = None) -> MutableMapping[str, str]:
        """`headers` with the `traceparent` (and `tracestate`) of `span`, else of the
        current span; unchanged when tracing is off or no span is current."""
        if self._propagator is None:
            return headers
        from opentelemetry import trace

        context = trace.set_span_in_context(span.raw) if span is not None else None
        self._propagator.inject(headers, context)
        return headers

    def current(self) -> Span:
        """The current span (a non-recording one when there is none)."""
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry import trace

        return Span(trace.get_current_span())

    def shutdown(self) -> None:
        """Export what is still queued and stop (at the process's end)."""
        if self._provider is not None:
            self._provider.shutdown()


class _Current:
    """A span made current for a `with` block (OpenTelemetry's context, attached and
    detached on the same task)."""

    __slots__ = ("span", "_token")

    def __init__(self, span: Span) -> None:
        self.span = span
        self._token: Token[Context] | None = None

    def __enter__(self) -> Span:
        from opentelemetry import context, trace

        self._token = context.attach(trace.set_span_in_context(self.span.raw))
        return self.span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 _tb: TracebackType | None) -> None:
        from opentelemetry import context

        assert self._token is not None  # __enter__ set it
        context.detach(self._token)
        if exc is not None:
            if isinstance(exc, Exception):
                self.span.raw.record_exception(exc)
                self.span.error(f"{type(exc).__name__}: {exc}")
            else:  # CancelledError, GeneratorExit: not the request's error
                self.span.set("cancelled", True)
        self.span.end()


def _kind(name: str) -> Callable[[], SpanKind]:
    def get() -> SpanKind:
        from opentelemetry.trace import SpanKind

        return SpanKind[name]
    return get


_KINDS = {"server": _kind("SERVER"), "client": _kind("CLIENT"),
          "internal": _kind("INTERNAL")}


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as the epoch nanoseconds `start(start_ns=)` and
    `Span.end(end_ns=)` take (for spans recorded after the fact from engine timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
