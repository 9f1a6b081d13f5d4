"""Tracing (`common.tracing`) through the router: a request continues the client's trace,
its remote prefill and each attempt are child spans, and every worker call carries the
`traceparent` of the span it belongs to. Off, it records and imports nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton.common.tracing import NO_SPAN, otlp_endpoint, setup_tracing
from baton.router.scheduling.disagg import DisaggSettings
from tests.unit.router.fakes import FakePod, chat, post, prefill_answer, start, stop

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN = 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{CLIENT_SPAN:016x}-01"


async def pods_answer(pod: FakePod, request: web.Request, body: bytes):
    if request.path == "/internal/prefill":
        return web.Response(body=prefill_answer([1, 2]).model_dump_json(),
                            content_type="application/json")
    if request.path == "/internal/generate" and not pod.failed:  # the first attempt
        pod.failed.append(pod)  # fails (a 503): a second one follows on the other pod
        return web.json_response({"error": {"message": "down"}}, status=503)
    return web.json_response({"id": "c", "choices": []})


def parent_of(traceparent: str) -> tuple[int, int]:
    """(trace id, parent span id) of a traceparent header."""
    _, trace, span, _ = traceparent.split("-")
    return int(trace, 16), int(span, 16)


def test_a_routed_request_continues_the_clients_trace_down_to_the_workers():
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("baton-router", exporter=exporter)

    async def main():
        prefill = FakePod("prefill", pods_answer)
        decodes = FakePod("decode", pods_answer), FakePod("decode", pods_answer)
        decodes[0].failed = decodes[1].failed = []  # shared
        router, pods = await start(prefill, *decodes, tracing=tracing,
                                   disagg=DisaggSettings(min_prefill_tokens=0))
        assert (await post(router, chat(), traceparent=TRACEPARENT))[0] == 200
        await stop(router, pods)
        return prefill, [h for pod in decodes for h in pod.headers]

    prefill, decode_headers = asyncio.run(main())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    attempts = [s for s in exporter.get_finished_spans() if s.name == "router.attempt"]
    request, remote = spans["router.request"], spans["router.prefill"]
    assert len(attempts) == 2 and len(decode_headers) == 2
    assert {s.context.trace_id for s in [request, remote, *attempts]} == {TRACE_ID}
    assert request.parent.span_id == CLIENT_SPAN and request.kind.name == "SERVER"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["baton.decision"] == "remote"
    assert {s.parent.span_id for s in [remote, *attempts]} == {request.context.span_id}
    assert parent_of(prefill.headers[0]["traceparent"]) == (TRACE_ID, remote.context.span_id)
    assert sorted(parent_of(h["traceparent"]) for h in decode_headers) == sorted(
        (TRACE_ID, a.context.span_id) for a in attempts)  # each attempt its own span
    failed, served = sorted(attempts, key=lambda a: a.status.is_ok)
    assert "status 503" in failed.status.description  # the Retryable that moved it on
    assert served.attributes["http.response.status_code"] == 200


def test_without_a_traceparent_the_router_starts_the_trace():
    exporter = InMemorySpanExporter()

    async def main():
        router, pods = await start(FakePod("both", pods_answer),
                                   tracing=setup_tracing("r", exporter=exporter))
        assert (await post(router, chat()))[0] == 200
        await stop(router, pods)
        return pods[0]

    pod = asyncio.run(main())
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "router.request"]
    assert request.parent is None
    assert parent_of(pod.headers[0]["traceparent"])[0] == request.context.trace_id


def test_off_tracing_records_and_imports_nothing():
    tracing = setup_tracing("baton-router", None)
    assert not tracing.enabled
    assert tracing.span("x", headers={"traceparent": TRACEPARENT}) is NO_SPAN
    assert tracing.start("y") is NO_SPAN
    headers = {"a": "b"}
    assert tracing.inject(headers) is headers and headers == {"a": "b"}
    code = ("import sys; from baton.common.tracing import setup_tracing; "
            "t = setup_tracing('x', None)\n"
            "with t.span('s') as s: s.set('k', 1); t.inject({})\n"
            "sys.exit(1 if any(m.startswith('opentelemetry') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("flag, env, url", [
    (None, {}, None),
    ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
    ("http://collector:4318/v1/traces", {}, "http://collector:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/x",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"}, "http://c:9/x"),
    ("http://flag:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/x"},
     "http://flag:4318/v1/traces"),
])
def test_the_otlp_endpoint_comes_from_the_flag_or_the_standard_variables(flag, env, url):
    assert otlp_endpoint(flag, env) == url


def test_an_endpoint_turns_tracing_on_and_a_bad_one_is_refused():
    tracing = setup_tracing("baton-router", "http://127.0.0.1:9/v1/traces")
    assert tracing.enabled
    tracing.shutdown()
    with pytest.raises(ValueError, match="OTLP endpoint"):
        otlp_endpoint("grpc://collector:4317", {})
