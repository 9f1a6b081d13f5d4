"""The router's hardening with real processes (issue 21): a real prefill pod and a router
sharing an internal token, a tenant keys file, and a stand-in decode pod that never answers
(so requests stop between the prefill and the decode): a prompt the prefill pod refuses is
answered once, at once; tenants are held to their keys and limits; a client that leaves
after its prefill has the lease released on the prefill pod long before its TTL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import Proc, free_port_run, http_get, metric_value, wait_for

pytestmark = pytest.mark.slow
TOKEN = "integration-internal-token-0123"
KEY = "sk-team-a-integration"
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1",
         "--max-model-len", "512", "--kv-lease-ttl", "120"]

# A decode pod that reports itself ready and never answers /internal/generate; it prints
# the headers of each call (one JSON line) so the test sees what the router sent.
STAND_IN_DECODE = """
import asyncio, json, sys
from aiohttp import web

async def load(_request):
    return web.json_response({"ready": True, "role": "decode", "model": sys.argv[2],
                              "running": 0, "waiting": 0, "kv_blocks_used": 0,
                              "kv_blocks_total": 64})

async def generate(request):
    print(json.dumps(dict(request.headers)), flush=True)
    await asyncio.sleep(600)

app = web.Application()
app.router.add_get("/load", load)
app.router.add_post("/internal/generate", generate)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port = free_port_run(3)
    logs = tmp_path_factory.mktemp("hardening")
    env = {"BATON_INTERNAL_TOKEN": TOKEN}
    urls = [f"http://127.0.0.1:{port + i}" for i in range(3)]
    prefill = Proc(["serve", "--port", str(port + 1), "--role", "prefill", *FLAGS],
                   logs / "prefill.log", extra_env=env).start()
    prefill.wait_ready(urls[1])
    model = json.loads(http_get(urls[1] + "/load")[1])["model"]
    decode_log = logs / "decode.log"
    with open(decode_log, "wb") as out:
        decode = subprocess.Popen([sys.executable, "-c", STAND_IN_DECODE, str(port + 2),
                                   model], stdout=out, stderr=subprocess.STDOUT)
    keys = logs / "keys.yaml"
    keys.write_text(f"tenants:\n  - name: team-a\n    keys: ['{KEY}']\n"
                    f"    requests_per_second: 2\n")
    router = Proc(["router", "--port", str(port), "--workers", ",".join(urls[1:]),
                   "--disagg-min-prefill-tokens", "4", "--check-interval", "0.2",
                   "--api-keys-file", str(keys)], logs / "router.log", extra_env=env).start()
    router.wait_ready(urls[0])
    yield {"router": urls[0], "prefill": urls[1], "model": model, "decode_log": decode_log}
    router.stop()
    decode.kill()  # its handlers sleep: no graceful shutdown to wait for
    decode.wait(10)
    assert prefill.stop()


def chat(model: str, content: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, **extra}


def post(url: str, body: dict, key: str | None = KEY, timeout: float = 60.0):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_a_prompt_the_prefill_pod_refuses_is_answered_once_at_once(cluster):
    t0 = time.monotonic()
    status, _, body = post(cluster["router"], chat(cluster["model"], "hello " * 2000))
    assert status == 400, body
    assert time.monotonic() - t0 < 10
    assert "error" in json.loads(body)
    assert metric_value(cluster["router"], "baton:fallbacks_total", default=0.0) == 0
    assert cluster["decode_log"].read_text() == ""  # no local prefill was tried


def test_tenants_need_their_key_and_keep_to_their_rate(cluster):
    router = cluster["router"]
    assert post(router, chat(cluster["model"], "hi"), key=None)[0] == 401
    assert post(router, chat(cluster["model"], "hi"), key="sk-wrong")[0] == 401
    assert http_get(router + "/workers")[0] == 401
    assert http_get(router + "/health")[0] == 200 and http_get(router + "/metrics")[0] == 200
    time.sleep(1.1)  # a full bucket (2 requests a second)
    too_long = chat(cluster["model"], "hello " * 2000)  # refused by the prefill pod: fast
    answers = [post(router, too_long) for _ in range(3)]
    assert [a[0] for a in answers] == [400, 400, 429]
    assert answers[2][1]["Retry-After"] == "1"


def test_a_client_that_leaves_after_its_prefill_has_the_lease_released(cluster):
    if release_endpoint(cluster["prefill"]) in (404, 405):
        pytest.skip("this worker has no /internal/release yet")
    time.sleep(1.1)
    with pytest.raises(TimeoutError):  # the stand-in decode pod never answers
        post(cluster["router"], chat(cluster["model"], "Tell me about the sea."), timeout=3.0)
    prefill = cluster["prefill"]
    wait_for(lambda: metric_value(prefill, "baton:kv_leases_held") == 0
             and metric_value(prefill, "baton:kv_blocks_used") == 0, 10,
             "the prefill pod to free the lease (TTL 120 s)")
    assert metric_value(cluster["router"], 'baton:router_kv_releases_total{result="released"}',
                        default=0.0) >= 1
    (headers,) = [json.loads(line) for line in cluster["decode_log"].read_text().splitlines()]
    assert headers.get("X-Baton-Token") == TOKEN and "Authorization" not in headers


def release_endpoint(url: str) -> int:
    """The status of a release of an unknown lease (404 / 405: no such endpoint)."""
    req = urllib.request.Request(url + "/internal/release", data=b'{"lease_id": "none"}',
                                 headers={"Content-Type": "application/json",
                                          "X-Baton-Token": TOKEN})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
