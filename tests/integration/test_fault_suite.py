"""The fault and bad-input suite (issue 21) against real processes on loopback, configured
as the chart does it: router + 1 prefill + 2 decode pods, an internal token on every
process and an API key. Poisoned fields, duplicate request ids, junk on the KV port,
slowloris connections, clients that leave and direct calls without credentials: no engine
dies from a request, nothing hangs past its deadline, no 5xx for bad input, and once idle
no pod holds a block or a lease."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import aiohttp
import pytest

from tests.integration.conftest import (
    MODEL,
    Proc,
    assert_idle,
    free_port_run,
    http_get,
    metric_value,
    wait_for,
)

pytestmark = pytest.mark.slow
TOKEN = "internal-token-for-the-fault-suite"
KEY = "sk-fault-suite"
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1"]
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 2.0
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    port = free_port_run(5)
    logs = tmp_path_factory.mktemp("fault-suite")
    env = {"BATON_INTERNAL_TOKEN": TOKEN, "BATON_API_KEY": KEY}
    url = {name: f"http://127.0.0.1:{port + i}" for i, name in
           enumerate(("router", "prefill", "decode-a", "decode-b"))}
    kv_port = port + 4
    procs = {
        "prefill": Proc(["serve", "--port", str(port + 1), "--role", "prefill",
                         "--kv-port", str(kv_port), "--kv-lease-ttl", "5", *FLAGS],
                        logs / "prefill.log", extra_env=env),
        **{name: Proc(["serve", "--port", str(port + i), "--role", "decode",
                       "--kv-transfer-timeout", "3", *FLAGS], logs / f"{name}.log",
                      extra_env=env) for i, name in ((2, "decode-a"), (3, "decode-b"))}}
    for p in procs.values():
        p.start()
    for name, p in procs.items():
        p.wait_ready(url[name])
    workers = ",".join(url[n] for n in procs)
    router = Proc(["router", "--port", str(port), "--workers", workers,
                   "--disagg-min-prefill-tokens", "16", "--check-interval", "0.2",
                   "--header-timeout", str(HEADER_TIMEOUT_S),
                   "--request-timeout", str(DEADLINE_S)], logs / "router.log",
                  extra_env=env).start()
    router.wait_ready(url["router"])
    yield {"url": url, "procs": procs, "kv_port": kv_port, "router": router}
    for p in (router, *procs.values()):
        if p.proc.poll() is None:
            assert p.stop()


def chat(content: str = "Say hello.", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0} | extra


async def _post(session, url: str, payload, headers=None, timeout: float = DEADLINE_S):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with session.post(url, data=data, headers={"Content-Type": "application/json",
                                                     **(headers or {})},
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, await r.read()


def post(url: str, payload, headers=None, timeout: float = DEADLINE_S):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await _post(s, url, payload, headers, timeout)
    return asyncio.run(go())


def assert_all_alive(pods) -> None:
    for name, u in pods["url"].items():
        assert http_get(u + "/health", 2)[0] == 200, f"{name} is not healthy"
        if name != "router":
            assert pods["procs"][name].proc.poll() is None, f"{name} exited"
    code, raw = post(pods["url"]["router"] + "/v1/chat/completions", chat(), AUTH)
    assert code == 200, raw


def _leases(pods) -> float:
    return metric_value(pods["url"]["prefill"], "baton:kv_leases_held")


def assert_nothing_held(pods, timeout: float = 15.0) -> None:
    workers = [u for n, u in pods["url"].items() if n != "router"]
    assert_idle(workers, timeout)
    wait_for(lambda: _leases(pods) == 0, timeout, "the prefill pod to hold no lease")


LONG = "Tell me about the sea. " * 12  # long enough for a remote prefill
POISON = [  # (why, body): each must be a 4xx from the router, and harm nothing
    ("seed past 64 bits", chat(temperature=1.0, seed=1 << 64)),
    ("seed below int64", chat(temperature=1.0, seed=-(1 << 63) - 1)),
    ("stop id outside the vocabulary", chat(min_tokens=2, stop_token_ids=[1000000])),
    ("stop id past 31 bits", chat(stop_token_ids=[1 << 40])),
    ("negative stop id", chat(stop_token_ids=[-1])),
    ("NaN temperature", b'{"model": "%s", "messages": [{"role": "user", "content": "x"}],'
                        b' "temperature": NaN}' % MODEL.encode()),
    ("infinite penalty", b'{"model": "%s", "messages": [{"role": "user", "content": "x"}],'
                         b' "repetition_penalty": Infinity}' % MODEL.encode()),
    ("temperature as a string", chat(temperature="0.5")),
    ("n of 1000", chat(n=1000)),
    ("top_logprobs of 1000", chat(logprobs=True, top_logprobs=1000)),
    ("top_logprobs without logprobs", chat(top_logprobs=2)),
    ("max_tokens 0", chat(max_tokens=0)),
    ("max_tokens past the context", chat(max_tokens=10**12)),
    ("min_tokens above max_tokens", chat(min_tokens=9, max_tokens=8)),
    ("top_p 0", chat(top_p=0)),
    ("top_k -2", chat(top_k=-2)),
    ("min_p 2", chat(min_p=2)),
    ("presence_penalty 5", chat(presence_penalty=5)),
    ("repetition_penalty 0", chat(repetition_penalty=0)),
    ("empty stop string", chat(stop=[""])),
    ("a thousand stop strings", chat(stop=["x"] * 1000)),
    ("unknown field", chat(frobnicate=True)),
    ("no messages", {"model": MODEL, "messages": []}),
    ("message without content", {"model": MODEL, "messages": [{"role": "user"}]}),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("content as a number", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
    ("stream_options without stream", chat(stream_options={"include_usage": True})),
    ("unknown model", chat() | {"model": "nope"}),
    ("not JSON", b"{this is not json"),
    ("JSON but a list", b"[1, 2, 3]"),
    ("empty body", b""),
    ("a prompt far past the context", chat(content="word " * 20000)),
    ("long prompt with a poisoned seed (remote prefill)", chat(LONG, temperature=1.0,
                                                                seed=1 << 64)),
    ("long prompt with a poisoned stop id (remote prefill)", chat(LONG, min_tokens=1,
                                                                   stop_token_ids=[10**7])),
]
COMPLETION_POISON = [
    ("prompt ids outside the vocabulary", {"model": MODEL, "prompt": [1, 2, 10**7]}),
    ("prompt id past 64 bits", {"model": MODEL, "prompt": [1, 1 << 70]}),
    ("empty prompt list", {"model": MODEL, "prompt": []}),
    ("echo with logprobs 50", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 50}),
    ("logprobs 50", {"model": MODEL, "prompt": "x", "logprobs": 50}),
]


def test_poisoned_fields_get_a_4xx_and_harm_no_engine(pods):
    router = pods["url"]["router"]
    results = []
    cases = ([("/v1/chat/completions", why, b) for why, b in POISON]
             + [("/v1/completions", why, b) for why, b in COMPLETION_POISON])
    for path, why, body in cases:
        for stream in (False, True):
            if stream and (isinstance(body, bytes) or "stream_options" in body):
                break  # no stream variant (streaming would make this one valid)
            if stream:
                body = body | {"stream": True}
            t0 = time.monotonic()
            code, raw = post(router + path, body, AUTH, timeout=30)
            results.append((why, stream, code, time.monotonic() - t0))
            assert 400 <= code < 500, f"{why} (stream={stream}): {code} {raw[:300]!r}"
            assert time.monotonic() - t0 < 10, f"{why}: {time.monotonic() - t0:.1f}s"
    assert_all_alive(pods)
    assert_nothing_held(pods)


def test_the_largest_seed_is_served_and_its_children_wrap(pods):
    code, raw = post(pods["url"]["router"] + "/v1/chat/completions",
                     chat(temperature=1.0, seed=(1 << 64) - 1, n=3), AUTH)
    assert code == 200, raw
    assert len(json.loads(raw)["choices"]) == 3


def test_duplicate_request_ids_are_served_independently(pods):
    router, prefill = pods["url"]["router"], pods["url"]["prefill"]

    async def stream(session, content: str) -> tuple[int, str]:
        payload = chat(content, max_tokens=16, stream=True)
        async with session.post(router + "/v1/chat/completions", json=payload,
                                headers=AUTH | {"X-Request-Id": "dup-1"},
                                timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as r:
            return r.status, (await r.read()).decode()

    async def go():
        async with aiohttp.ClientSession() as s:
            streams = [stream(s, LONG + str(i)) for i in range(3)]
            prefills = [_post(s, prefill + "/internal/prefill",
                              {"api": "chat", "request": chat(LONG)},
                              {"X-Request-Id": "dup-prefill-0", "X-Baton-Token": TOKEN})
                        for _ in range(3)]
            return await asyncio.gather(*streams, *prefills)

    t0 = time.monotonic()
    results = asyncio.run(go())
    assert time.monotonic() - t0 < DEADLINE_S
    for status, text in results[:3]:
        assert status == 200 and "[DONE]" in text and '"finish_reason":"length"' in text, text
    leases = set()
    for status, raw in results[3:]:
        assert status == 200, raw
        leases.add(json.loads(raw)["kv_transfer_params"]["lease_id"])
    assert len(leases) == 3 and not any("dup" in lease for lease in leases)
    assert_all_alive(pods)
    assert_nothing_held(pods)  # the three unpulled leases expire (5 s TTL)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_junk_on_the_kv_port_costs_the_holder_nothing(pods):
    pid = pods["procs"]["prefill"].proc.pid
    before = _rss_mib(pid)
    junk = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", struct.pack(">I", 256 << 20) + b"\0" * 64,
            struct.pack("<I", 0xFFFFFFFF), b"\x00" * 4096, b""]
    socks = []
    for data in junk:
        s = socket.create_connection(("127.0.0.1", pods["kv_port"]), timeout=5)
        if data:
            s.sendall(data)
        socks.append(s)
    t0 = time.monotonic()
    assert http_get(pods["url"]["prefill"] + "/health", 2)[0] == 200
    assert time.monotonic() - t0 < 1.0
    time.sleep(1.0)
    assert _rss_mib(pid) - before < 32, f"RSS grew {_rss_mib(pid) - before:.0f} MiB"
    closed = 0
    for s in socks:
        s.settimeout(10)
        try:
            closed += s.recv(1) == b""
        except (ConnectionResetError, socket.timeout):
            closed += 1
        s.close()
    assert closed == len(socks)  # refused, or closed at the handshake deadline
    code, raw = post(pods["url"]["router"] + "/v1/chat/completions", chat(LONG), AUTH)
    assert code == 200, raw  # pulls still work
    assert_all_alive(pods)


def test_slowloris_connections_are_closed_and_others_served(pods):
    router = pods["url"]["router"]
    host, port = "127.0.0.1", int(router.rsplit(":", 1)[1])
    socks = []
    for _ in range(40):
        s = socket.create_connection((host, port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        socks.append(s)
    t0 = time.monotonic()
    assert http_get(router + "/health", 2)[0] == 200
    assert time.monotonic() - t0 < 1.0
    deadline = time.monotonic() + HEADER_TIMEOUT_S + 5
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            data = s.recv(4096)
        except socket.timeout:
            pytest.fail("a slowloris connection stayed open past the header timeout")
        except ConnectionResetError:
            data = b""
        assert data == b"" or data.startswith(b"HTTP/1.1 408"), data[:100]
        s.close()


def test_clients_that_leave_leave_nothing_behind(pods):
    router = pods["url"]["router"]

    async def leave_after(session, n_events: int, content: str) -> None:
        payload = chat(content, max_tokens=64, stream=True)
        async with session.post(router + "/v1/chat/completions", json=payload,
                                headers=AUTH) as r:
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: ")
                if seen >= n_events:
                    r.close()
                    return

    async def give_up(session, content: str) -> None:
        try:
            await _post(session, router + "/v1/chat/completions",
                        chat(content, max_tokens=64), AUTH, timeout=0.3)
        except asyncio.TimeoutError:
            pass

    async def go():
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*[leave_after(s, 1 + i, LONG + str(i)) for i in range(4)],
                                 *[give_up(s, LONG + "x" * i) for i in range(4)])

    asyncio.run(go())
    assert_nothing_held(pods, timeout=20)
    assert_all_alive(pods)


def test_internal_ports_and_worker_lists_need_credentials(pods):
    url = pods["url"]
    assert post(url["prefill"] + "/internal/prefill", {"api": "chat", "request": chat()})[0] \
        == 401
    assert post(url["decode-a"] + "/internal/generate", {"api": "chat", "request": chat()})[0] \
        == 401
    assert post(url["decode-a"] + "/v1/chat/completions", chat())[0] == 401
    assert post(url["decode-a"] + "/v1/chat/completions", chat(), AUTH)[0] == 200
    assert post(url["router"] + "/v1/chat/completions", chat())[0] == 401
    assert http_get(url["router"] + "/workers")[0] == 401
    assert http_get(url["router"] + "/health")[0] == 200
    for p in (pods["router"], *pods["procs"].values()):  # keys never reach a log
        text = p.log_path.read_text()
        assert TOKEN not in text and KEY not in text
