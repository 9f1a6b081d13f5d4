"""A worker's spans continue the caller's trace: the request's span is a child of the
incoming `traceparent`, with the queue time as a child span and the first token as an
event; the prefill role's request gets its own span."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton.common.roles import Role
from baton.common.tracing import setup_tracing
from baton.worker.app import build_app
from baton.worker.pipeline import Pipeline
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.worker.fakes import MODEL, FakeEngine, asgi_call, kv_params, make_pipeline, out

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def traced_app(role: Role, engine: FakeEngine | None = None):
    exporter = InMemorySpanExporter()
    state = WorkerState(WorkerSettings(role=role))
    state.tracing = setup_tracing("baton-test", exporter=exporter)
    pipeline, state.engine, _ = make_pipeline(engine)
    state.pipeline = Pipeline(pipeline.serving, pipeline.format, state.tracing)
    return build_app(state.settings, state), exporter


def test_a_request_span_continues_the_callers_trace():
    app, exporter = traced_app(Role.BOTH)
    code, _, _ = asyncio.run(asgi_call(app, "POST", "/v1/chat/completions", CHAT,
                                       {"traceparent": PARENT}))
    assert code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request = spans["worker.chat"]
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert spans["worker.queue"].parent.span_id == request.context.span_id
    assert [e.name for e in request.events] == ["first_token"]


def test_the_prefill_role_traces_its_prefill():
    held = kv_params(3)
    app, exporter = traced_app(Role.PREFILL, FakeEngine(lambda r: [[out(
        r.request_id, [5], finish="length", kv_transfer_params=held)]]))
    code, _, _ = asyncio.run(asgi_call(app, "POST", "/internal/prefill",
                                       {"api": "chat", "request": CHAT},
                                       {"traceparent": PARENT}))
    assert code == 200
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "worker.prefill"]
    assert format(span.context.trace_id, "032x") == TRACE_ID
