"""/metrics on the worker and the router: the contract names, and promtool's lint."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.integration.conftest import MODEL, http_get, metric_value, post_json, promtool

pytestmark = pytest.mark.slow

WORKER_METRICS = {
    "baton:time_to_first_token_seconds": "histogram",
    "baton:inter_token_latency_seconds": "histogram",
    "baton:e2e_request_latency_seconds": "histogram",
    "baton:queue_time_seconds": "histogram",
    "baton:num_requests_running": "gauge",
    "baton:num_requests_waiting": "gauge",
    "baton:kv_blocks_used": "gauge",
    "baton:kv_blocks_total": "gauge",
    "baton:prompt_tokens_total": "counter",
    "baton:generation_tokens_total": "counter",
    "baton:prefix_cache_hit_tokens_total": "counter",
    "baton:preemptions_total": "counter",
    "baton:requests_total": "counter",
}
ROUTER_METRICS = {
    "baton:router_requests_total": "counter",
    "baton:router_upstream_latency_seconds": "histogram",
    "baton:router_upstream_errors_total": "counter",
    "baton:router_retries_total": "counter",
}


def _types(page: str) -> dict[str, str]:
    out = {}
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind
    return out


# Findings the metric contract itself implies: the `baton:` colon namespace, and the gauge
# `baton:kv_blocks_total` (the pool size, named by the contract) that promtool would want
# without `_total`. Anything else promtool says is a failure.
ALLOWED = ("should not contain ':'",
           'baton:kv_blocks_total non-counter metrics should not have "_total" suffix')


def _promtool_problems(page: bytes) -> list[str]:
    """promtool's findings other than the ALLOWED ones."""
    r = subprocess.run([promtool(), "check", "metrics"], input=page, capture_output=True,
                       timeout=30)
    assert r.returncode in (0, 3), r.stderr.decode() + r.stdout.decode()  # 1 = unparsable
    lines = (r.stdout + r.stderr).decode().splitlines()
    return [ln for ln in lines if ln.strip() and not any(a in ln for a in ALLOWED)]


def test_metrics_names_values_and_lint(cluster):
    worker = cluster.workers[0]
    prompt = "A shared prefix that is long enough to fill at least two KV blocks of sixteen "
    prompt += "tokens each, so that the second request hits the prefix cache. " * 2
    for _ in range(2):
        code, _, _ = post_json(worker + "/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": False})
        assert code == 200
    post_json(cluster.router + "/v1/completions", {"model": MODEL, "prompt": "x",
                                                   "max_tokens": 2})
    _, page = http_get(worker + "/metrics")
    types = _types(page.decode())
    for name, kind in WORKER_METRICS.items():
        assert types.get(name.removesuffix("_total") if kind == "counter" else name) == kind \
            or types.get(name) == kind, (name, kind)
    assert metric_value(worker, "baton:generation_tokens_total") >= 10
    assert metric_value(worker, "baton:prompt_tokens_total") > 0
    assert metric_value(worker, "baton:prefix_cache_hit_tokens_total") >= 16
    assert metric_value(worker, "baton:kv_blocks_total") == 384
    assert metric_value(worker, "baton:time_to_first_token_seconds_count") >= 2
    assert metric_value(worker, 'baton:requests_total{finish_reason="length"}') >= 2

    _, rpage = http_get(cluster.router + "/metrics")
    rtypes = _types(rpage.decode())
    for name, kind in ROUTER_METRICS.items():
        assert rtypes.get(name.removesuffix("_total")) == kind or rtypes.get(name) == kind, name
    assert metric_value(cluster.router,
                        'baton:router_requests_total{code="200",tenant="default"}') >= 1

    if promtool() is None:
        if os.environ.get("BATON_REQUIRE_PROMTOOL"):
            pytest.fail("promtool is required here (BATON_REQUIRE_PROMTOOL) but not installed")
        pytest.skip("promtool is not installed (make setup installs Debian's prometheus)")
    assert _promtool_problems(page) == []
    assert _promtool_problems(rpage) == []
