"""The real `KubernetesClient` (official client, over HTTP) against kmock's in-memory
Kubernetes API emulator, and the planner loop scaling Deployments through it.

kmock serves `GET/PATCH .../deployments/NAME/scale` from the stored Deployment itself (it
does not model subresources), which is what the client reads (`spec.replicas`) and patches
(`{"spec": {"replicas": n}}`). Its gaps do not matter here: the planner uses no label
selector and no resourceVersion, and the seeded objects carry `metadata.namespace`.
The emulator runs on its own event loop in a thread; the client is synchronous.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from baton.common.metrics import RouterMetrics, render
from baton.planner.base import KubeError
from baton.planner.kube import KubernetesClient
from baton.planner.metrics_source import ScrapeSource
from baton.planner.plan import SLO, PlanSettings
from baton.planner.scaler import Scaler, ScalerConfig, profile_plan_fn
from tests.unit.planner.factories import make_profile, make_workload

kmock = pytest.importorskip("kmock")

DEPLOYMENTS = "apps/v1/deployments"


class Emulator:
    """kmock's KubernetesEmulator + an HTTP server, on an event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.handler, self.server = self._call(self._start())
        self.url = str(self.server.url)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self):
        handler = kmock.KubernetesEmulator()
        await handler.__aenter__()
        server = kmock.Server(handler)
        await server.__aenter__()
        return handler, server

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.handler.__aexit__(None, None, None)

    def seed(self, namespace: str, name: str, replicas: int) -> None:
        async def put():
            self.handler.objects[DEPLOYMENTS, namespace, name] = {
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": replicas}, "status": {"replicas": replicas}}
        self._call(put())

    def replicas(self, namespace: str, name: str) -> int:
        async def read():
            return self.handler.objects[DEPLOYMENTS, namespace, name].raw["spec"]["replicas"]
        return self._call(read())

    def close(self) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def emulator():
    em = Emulator()
    yield em
    em.close()


class RouterPage:
    """The router's /metrics on loopback; `total` is what the next scrape reports."""

    def __init__(self) -> None:
        self.total = 0
        page = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                m = RouterMetrics()
                m.requests.labels(code="200", tenant="default").inc(page.total)
                body = render(m.registry)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def test_reads_and_scales_a_deployment(emulator):
    emulator.seed("prod", "baton-decode", 2)
    emulator.seed("staging", "baton-decode", 7)
    client = KubernetesClient(emulator.url)
    assert client.get_replicas("prod", "baton-decode") == 2
    client.scale("prod", "baton-decode", 5)
    assert client.get_replicas("prod", "baton-decode") == 5
    assert emulator.replicas("prod", "baton-decode") == 5
    assert emulator.replicas("staging", "baton-decode") == 7  # another namespace untouched


def test_api_failures_are_kube_errors_naming_the_deployment(emulator):
    client = KubernetesClient(emulator.url)
    with pytest.raises(KubeError, match=r"read deployments/absent/scale in namespace 'prod':"
                                        r" HTTP 404 .*does the Deployment exist"):
        client.get_replicas("prod", "absent")
    with pytest.raises(KubeError, match=r"scale deployments/absent/scale"):
        client.scale("prod", "absent", 3)
    down = KubernetesClient("http://127.0.0.1:9")
    with pytest.raises(KubeError, match=r"read deployments/x/scale .*Connection refused"):
        down.get_replicas("prod", "x")


def test_planner_loop_scales_the_deployments_through_the_api(emulator):
    emulator.seed("prod", "baton-prefill", 1)
    emulator.seed("prod", "baton-decode", 1)
    page = RouterPage()
    config = ScalerConfig("prod", "baton-prefill", "baton-decode", interval_s=0.05,
                          max_prefill=4, max_decode=4, scale_down_after=2)
    plan_fn = profile_plan_fn(make_profile(), make_workload(rate=1),
                              PlanSettings(SLO(1.0, 0.05)), config)
    clock = iter(range(0, 10_000, 10))  # each scrape 10 s after the previous one
    metrics = ScrapeSource(page.url, clock=lambda: float(next(clock)))
    scaler = Scaler(config, KubernetesClient(emulator.url), metrics, plan_fn)
    try:
        page.total = 1000
        scaler.tick()  # the baseline scrape
        page.total = 1200  # 20 req/s over the next 10 s: 3 prefill + 3 decode
        scaler.run(max_ticks=1)
        assert emulator.replicas("prod", "baton-prefill") == 3
        assert emulator.replicas("prod", "baton-decode") == 3
        page.total = 1210  # 1 req/s: fewer wanted, but not twice in a row yet
        report = scaler.tick()
        assert [d.action for d in report.pools] == ["wait", "wait"]
        assert emulator.replicas("prod", "baton-decode") == 3
        page.total = 1220
        scaler.tick()
        assert emulator.replicas("prod", "baton-prefill") == 1
        assert emulator.replicas("prod", "baton-decode") == 1
    finally:
        page.close()


def test_a_missing_client_library_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` now fails
    with pytest.raises(KubeError, match=r"pip install kubernetes==37\.0\.2"):
        KubernetesClient("http://127.0.0.1:9")
