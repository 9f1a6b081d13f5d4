"""ScrapeSource against real HTTP servers on loopback whose counters change between
scrapes: rates from deltas, lengths when the page has worker series, errors typed, and
several router pods behind one name (a headless Service) each compared with itself."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from baton.common.metrics import RouterMetrics, WorkerMetrics, render
from baton.common.stats import EngineStats
from baton.planner.base import MetricsError
from baton.planner.metrics_source import ScrapeSource


class Pages:
    """Serves the queued pages in order (the last one again when the queue runs out)."""

    def __init__(self) -> None:
        self.pages: list[tuple[int, bytes]] = []
        self.served = 0

    def push(self, body: bytes, status: int = 200) -> None:
        self.pages.append((status, body))

    def next(self) -> tuple[int, bytes]:
        self.served += 1
        return self.pages.pop(0) if len(self.pages) > 1 else self.pages[0]


def start_server(host: str = "127.0.0.1", port: int = 0):
    """A page server on `host:port`; returns (pages, url, stop)."""
    pages = Pages()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = pages.next()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()

    def stop():
        httpd.shutdown()
        httpd.server_close()
        thread.join()

    return pages, f"http://{host}:{httpd.server_address[1]}/metrics", stop


@pytest.fixture
def server():
    pages, url, stop = start_server()
    yield pages, url
    stop()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router_page(ok: int, refused: int) -> bytes:
    m = RouterMetrics()  # the router's own registry, rendered as the router serves it
    m.requests.labels(code="200", tenant="team-a").inc(ok)
    m.requests.labels(code="429", tenant="team-b").inc(refused)
    return render(m.registry)


def worker_page(finished: int, prompt: int, generated: int) -> bytes:
    m = WorkerMetrics(lambda: EngineStats(prompt_tokens_total=prompt,
                                          generation_tokens_total=generated, running=3))
    m.requests.labels("stop").inc(finished)
    return render(m.registry)


def test_router_page_gives_the_rate_and_no_lengths(server):
    pages, url = server
    pages.push(router_page(ok=100, refused=10))
    pages.push(router_page(ok=160, refused=30))  # +80 requests in 20 s
    clock = Clock()
    source = ScrapeSource(url, clock=clock)
    assert source.sample() is None  # the first scrape is the baseline
    clock.now += 20.0
    est = source.sample()
    assert est.rate == pytest.approx(4.0) and est.window_s == 20.0
    assert est.prompt_mean is None and est.output_mean is None
    assert est.source == "router"
    assert pages.served == 2


def test_worker_page_gives_mean_lengths(server):
    pages, url = server
    pages.push(worker_page(finished=10, prompt=5000, generated=1000))
    pages.push(worker_page(finished=30, prompt=17000, generated=3000))
    clock = Clock()
    source = ScrapeSource(url, clock=clock)
    source.sample()
    clock.now += 10.0
    est = source.sample()
    assert est.source == "worker"
    assert est.rate == pytest.approx(2.0)
    assert est.prompt_mean == pytest.approx(600.0)  # 12000 tokens / 20 requests
    assert est.output_mean == pytest.approx(100.0)


def test_federated_page_takes_the_rate_from_the_router_and_lengths_from_workers(server):
    pages, url = server
    two_workers = worker_page(5, 1000, 100) + worker_page(5, 1000, 100)
    pages.push(router_page(ok=10, refused=0) + two_workers)
    later = worker_page(15, 4000, 600) + worker_page(15, 4000, 600)  # +6000 / +1000 tokens
    pages.push(router_page(ok=30, refused=20) + later)
    clock = Clock()
    source = ScrapeSource(url, clock=clock)
    source.sample()
    clock.now += 5.0
    est = source.sample()
    assert est.source == "router"
    assert est.rate == pytest.approx(40 / 5)  # refused requests are demand too
    assert est.prompt_mean == pytest.approx(6000 / 20)  # per served (2xx) request
    assert est.output_mean == pytest.approx(1000 / 20)


def test_a_counter_reset_counts_from_zero(server):
    pages, url = server
    pages.push(router_page(ok=500, refused=0))
    pages.push(router_page(ok=30, refused=0))  # the router restarted
    clock = Clock()
    source = ScrapeSource(url, clock=clock)
    source.sample()
    clock.now += 10.0
    assert source.sample().rate == pytest.approx(3.0)


def test_page_without_request_counters_is_a_metrics_error(server):
    pages, url = server
    pages.push(b"# TYPE up gauge\nup 1\n")
    with pytest.raises(MetricsError, match="neither baton:router_requests_total nor "
                                           "baton:requests_total"):
        ScrapeSource(url).sample()


def test_http_errors_and_unreachable_servers_are_metrics_errors(server):
    pages, url = server
    pages.push(b"oops", status=500)
    with pytest.raises(MetricsError, match="HTTP 500"):
        ScrapeSource(url).sample()
    with pytest.raises(MetricsError, match="GET http://127.0.0.1:9/metrics"):
        ScrapeSource("http://127.0.0.1:9/metrics", timeout_s=2.0).sample()


def test_failed_scrape_keeps_the_baseline(server):
    pages, url = server
    pages.push(router_page(ok=10, refused=0))
    pages.push(b"down", status=503)
    pages.push(router_page(ok=70, refused=0))
    clock = Clock()
    source = ScrapeSource(url, clock=clock)
    source.sample()
    clock.now += 10.0
    with pytest.raises(MetricsError):
        source.sample()
    clock.now += 10.0
    assert source.sample().rate == pytest.approx(60 / 20)  # over both intervals


# -- several routers behind one name (the chart's headless Service) ------------------------
@pytest.fixture
def two_routers():
    """Two router pages on the same port of 127.0.0.1 and 127.0.0.2, and a resolver that
    answers both for "routers.baton.svc" (what DNS answers for a headless Service)."""
    a_pages, a_url, a_stop = start_server("127.0.0.1")
    port = int(a_url.rsplit(":", 1)[1].split("/")[0])
    b_pages, _, b_stop = start_server("127.0.0.2", port)
    answers = {"routers.baton.svc": ["127.0.0.1", "127.0.0.2"]}

    def resolve(host, _port):
        return answers[host]

    yield a_pages, b_pages, f"http://routers.baton.svc:{port}/metrics", resolve, answers
    a_stop()
    b_stop()


def test_two_routers_with_different_counters_add_up(two_routers):
    a, b, url, resolve, _ = two_routers
    a.push(router_page(ok=1000, refused=0))
    a.push(router_page(ok=1100, refused=0))  # +100 in 10 s
    b.push(router_page(ok=10, refused=0))
    b.push(router_page(ok=25, refused=5))  # +20 in 10 s
    clock = Clock()
    source = ScrapeSource(url, clock=clock, resolve=resolve)
    assert source.sample() is None
    clock.now += 10.0
    est = source.sample()
    # Through one ClusterIP the two pages alternate: 1000 -> 25 reads as a reset (2.5/s) and
    # 10 -> 1100 as 109/s. Per pod, the rate is the sum of both routers' rates.
    assert est.rate == pytest.approx(12.0) and est.source == "router"
    assert (a.served, b.served) == (2, 2)


def test_router_pods_that_come_fail_and_go(two_routers):
    a, b, url, resolve, answers = two_routers
    a.push(router_page(ok=100, refused=0))
    a.push(router_page(ok=200, refused=0))
    a.push(router_page(ok=300, refused=0))
    a.push(router_page(ok=400, refused=0))
    b.push(router_page(ok=5000, refused=0))
    b.push(b"down", status=503)
    b.push(router_page(ok=5060, refused=0))
    answers["routers.baton.svc"] = ["127.0.0.1"]  # only router a is ready at first
    clock = Clock()
    source = ScrapeSource(url, clock=clock, resolve=resolve)
    source.sample()
    answers["routers.baton.svc"] = ["127.0.0.1", "127.0.0.2"]  # b joins: a baseline only
    clock.now += 10.0
    assert source.sample().rate == pytest.approx(10.0)
    clock.now += 10.0  # b fails this round: a alone is counted, b keeps its baseline
    assert source.sample().rate == pytest.approx(10.0)
    clock.now += 10.0  # b is back: +60 over its 20 s window, a +100 over 10 s
    assert source.sample().rate == pytest.approx(10.0 + 3.0)
    answers["routers.baton.svc"] = []  # every router gone: an error, not a zero rate
    with pytest.raises(MetricsError, match="no address behind"):
        source.sample()


def test_dual_stack_names_count_each_pod_once(monkeypatch):
    import socket

    from baton.planner.metrics_source import expand, resolve_addresses

    def fake(host, port, type=0):
        return [(socket.AF_INET6, type, 6, "", ("fd00::1", port, 0, 0)),
                (socket.AF_INET, type, 6, "", ("10.0.0.7", port)),
                (socket.AF_INET, type, 6, "", ("10.0.0.5", port)),
                (socket.AF_INET, type, 6, "", ("10.0.0.7", port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert resolve_addresses("r", 8000) == ["10.0.0.5", "10.0.0.7"]
    assert expand("http://r:8000/metrics") == ["http://10.0.0.5:8000/metrics",
                                              "http://10.0.0.7:8000/metrics"]
    assert expand("http://r/metrics", lambda h, p: ["fd00::2"]) == ["http://[fd00::2]/metrics"]
