"""Bad input, disconnects and overload against real processes: every case ends in a clear
answer, the servers stay healthy, and no KV block is left held."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from tests.integration.conftest import (
    MODEL,
    Proc,
    assert_idle,
    free_port_run,
    kv_blocks_used,
    metric_value,
    post_json,
    wait_for,
)

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD_INPUT = [
    ("malformed json", CHAT, b'{"model": "x", "messages": [', 400, "invalid_request_error"),
    ("body not an object", CHAT, [1, 2], 400, "invalid_request_error"),
    ("missing model", CHAT, {"messages": MSG}, 400, "invalid_request_error"),
    ("missing messages", CHAT, {"model": MODEL}, 400, "invalid_request_error"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, "invalid_request_error"),
    ("bad role", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, "invalid_request_error"),
    ("image part", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "invalid_request_error"),
    ("temperature wrong type", CHAT, {"model": MODEL, "messages": MSG, "temperature": "hot"},
     400, "invalid_request_error"),
    ("temperature as string number", CHAT, {"model": MODEL, "messages": MSG,
                                            "temperature": "0.5"}, 400, "invalid_request_error"),
    ("temperature out of range", CHAT, {"model": MODEL, "messages": MSG, "temperature": 5},
     400, "invalid_request_error"),
    ("max_tokens zero", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400,
     "invalid_request_error"),
    ("n zero", CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400, "invalid_request_error"),
    ("top_logprobs too many", CHAT, {"model": MODEL, "messages": MSG, "logprobs": True,
                                     "top_logprobs": 50}, 400, "invalid_request_error"),
    ("top_logprobs without logprobs", CHAT, {"model": MODEL, "messages": MSG,
                                             "top_logprobs": 2}, 400, "invalid_request_error"),
    ("unsupported field", CHAT, {"model": MODEL, "messages": MSG, "tools": []}, 400,
     "invalid_request_error"),
    ("stream_options without stream", CHAT, {"model": MODEL, "messages": MSG,
                                             "stream_options": {"include_usage": True}},
     400, "invalid_request_error"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "not_found_error"),
    ("prompt too long", CMPL, {"model": MODEL, "prompt": [1] * 9000}, 400,
     "invalid_request_error"),
    ("prompt + max_tokens too long", CMPL, {"model": MODEL, "prompt": [1] * 8000,
                                            "max_tokens": 500}, 400, "invalid_request_error"),
    ("token id outside vocab", CMPL, {"model": MODEL, "prompt": [10 ** 9]}, 400,
     "invalid_request_error"),
    ("empty prompt", CMPL, {"model": MODEL, "prompt": ""}, 400, "invalid_request_error"),
    ("empty prompt list", CMPL, {"model": MODEL, "prompt": []}, 400, "invalid_request_error"),
    ("stop not a string", CMPL, {"model": MODEL, "prompt": "x", "stop": 5}, 400,
     "invalid_request_error"),
    ("negative seed type", CMPL, {"model": MODEL, "prompt": "x", "seed": 1.5}, 400,
     "invalid_request_error"),
]


@pytest.mark.parametrize("target", ["router", "worker"])
def test_bad_input_table(cluster, target):
    base = cluster.router if target == "router" else cluster.workers[0]
    for name, path, body, status, kind in BAD_INPUT:
        code, _, answer = post_json(base + path, body if isinstance(body, bytes)
                                    else json.dumps(body).encode())
        assert code == status, f"{name}: got {code} {answer}"
        err = answer["error"]
        assert err["type"] == kind, f"{name}: {err}"
        assert err["message"] and set(err) == {"message", "type", "param", "code"}, name
    code, _, ok = post_json(base + CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 4})
    assert code == 200 and ok["choices"][0]["message"]["content"]
    assert_idle(cluster.workers)


def _open_stream(url: str, body: dict) -> http.client.HTTPConnection:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("via", ["worker", "router"])
def test_disconnect_mid_stream_frees_blocks(cluster, via):
    worker = cluster.workers[0]
    base = worker if via == "worker" else cluster.router
    aborted_before = metric_value(worker, 'baton:requests_total{finish_reason="abort"}')
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    conns = []
    for _ in range(2 if via == "router" else 1):  # via the router: reach both workers
        conn = _open_stream(base + CMPL, body)
        resp = conn.getresponse()
        assert resp.status == 200
        for _ in range(5):
            assert resp.fp.readline()  # a few SSE lines: tokens are flowing
        conns.append(conn)
    assert sum(kv_blocks_used(w) for w in cluster.workers) > 0
    for conn in conns:
        conn.sock.close()
        conn.close()
    assert_idle(cluster.workers, timeout=15)
    if via == "worker":
        wait_for(lambda: metric_value(
            worker, 'baton:requests_total{finish_reason="abort"}') > aborted_before,
            5, "the abort to be counted")


def test_disconnect_non_streaming_frees_blocks(cluster):
    worker = cluster.workers[1]
    conn = _open_stream(worker + CMPL, {"model": MODEL, "prompt": "Once upon a time",
                                        "max_tokens": 4000, "ignore_eos": True})
    wait_for(lambda: kv_blocks_used(worker) > 0, 10, "the request to start")
    conn.sock.close()
    conn.close()
    assert_idle([worker], timeout=15)


@pytest.fixture(scope="module")
def small_worker(tmp_path_factory):
    """A worker with a tiny queue: 2 running, 3 waiting at most."""
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    proc = Proc(["serve", "--port", str(port), "--dtype", "float32", "--num-kv-blocks", "128",
                 "--max-num-seqs", "2", "--max-waiting", "3", "--num-threads", "1"],
                tmp_path_factory.mktemp("small") / "worker.log").start()
    proc.wait_ready(url)
    yield url
    assert proc.stop()


def test_overload_gets_429_and_admitted_complete(small_worker):
    n, max_tokens = 24, 12
    body = {"model": MODEL, "prompt": "Tell me a story about a dragon.",
            "max_tokens": max_tokens, "ignore_eos": True}
    barrier = threading.Barrier(n)

    def one(_):
        barrier.wait()
        return post_json(small_worker + CMPL, body, timeout=120)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == n, [r[0] for r in results]  # nothing else, nothing lost
    assert refused, "the queue should have overflowed"
    assert len(ok) >= 3  # the 3 waiting places were filled at least
    for _, headers, answer in refused:
        assert int(headers["Retry-After"]) >= 1
        assert answer["error"]["type"] == "rate_limit_error"
    for _, _, answer in ok:
        assert answer["usage"]["completion_tokens"] == max_tokens
        assert answer["choices"][0]["finish_reason"] == "length"
    assert_idle([small_worker])
    rejected = metric_value(small_worker, 'baton:requests_rejected_total{reason="queue_full"}')
    assert rejected == len(refused)
    # Still serving after the storm.
    assert post_json(small_worker + CMPL, body)[0] == 200


def test_slow_clients_do_not_block_each_other(cluster):
    """Many concurrent streams on one worker; all complete while one client reads slowly."""
    worker = cluster.workers[0]
    body = {"model": MODEL, "prompt": "Write a list of fruits:", "max_tokens": 16,
            "ignore_eos": True, "stream": True}
    slow = _open_stream(worker + CMPL, body | {"max_tokens": 64})
    slow_resp = slow.getresponse()
    t0 = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(lambda _: post_json(worker + CMPL, body | {"stream": False}),
                              range(12)))
    assert all(c[0] == 200 for c in codes)
    assert time.monotonic() - t0 < 60
    assert slow_resp.read().endswith(b"data: [DONE]\n\n")
    slow.close()
    assert_idle([worker])
