"""ScrapeSource against a real HTTP server on loopback whose counters change between
scrapes: rates from deltas, lengths when the page has worker series, errors typed."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from baton.common.metrics import RouterMetrics, WorkerMetrics, render
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


@pytest.fixture
def server():
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

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield pages, f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def router_page(ok: int, refused: int) -> bytes:
    m = RouterMetrics()  # the router's own registry, rendered as the router serves it
    m.requests.labels("200").inc(ok)
    m.requests.labels("429").inc(refused)
    return render(m.registry)


def worker_page(finished: int, prompt: int, generated: int) -> bytes:
    m = WorkerMetrics(lambda: {"baton:prompt_tokens_total": prompt,
                               "baton:generation_tokens_total": generated,
                               "baton:num_requests_running": 3})
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
