"""Tenants: the keys file's validation (errors name the field, never a key), token buckets,
and the router's answers: 401 without a key, 429 with Retry-After over a limit, the tenant
on the request metrics, /workers behind the key, probes open."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from baton.cli import _router_settings, build_parser
from baton.router.rate_limit import TokenBucket
from baton.router.settings import RouterSettings
from baton.router.tenants import TenantSpec, load_tenants
from tests.unit.router.fakes import (
    FakePod,
    chat,
    content,
    metric,
    post,
    start,
    stop,
    stream,
)

SECRET = "sk-team-a-0123456789"


def keys_file(tmp_path, text: str) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return str(path)


def test_a_keys_file_is_read_into_tenants(tmp_path):
    path = keys_file(tmp_path, f"""
tenants:
  - name: team-a
    keys: ["{SECRET}", "sk-second-key"]
    requests_per_second: 5
    tokens_per_minute: 60000
  - name: team-b
    keys: [sk-team-b]
""")
    a, b = load_tenants(path)
    assert (a.name, a.keys, a.requests_per_second, a.tokens_per_minute) == (
        "team-a", (SECRET, "sk-second-key"), 5.0, 60000)
    assert b.requests_per_second is None and b.tokens_per_minute is None
    assert SECRET not in repr(a)
    settings = RouterSettings(workers=("http://w:1",), api_key="sk-env", tenants=(a, b))
    assert SECRET not in repr(settings) and "sk-env" not in repr(settings)
    assert [t.name for t in settings.all_tenants] == ["default", "team-a", "team-b"]


@pytest.mark.parametrize("text, field", [
    ("tenants:\n  - name: a\n    keys: [SECRETKEY]\n    requests_per_second: 0\n",
     "tenants[0].requests_per_second"),
    ("tenants:\n  - name: a\n    keys: []\n", "tenants[0].keys"),
    ("tenants:\n  - name: a\n    keys: [SECRETKEY]\n    tokens_per_minute: -5\n",
     "tenants[0].tokens_per_minute"),
    ("tenants:\n  - name: a\n    keys: [SECRETKEY]\n  - name: b\n    keys: [SECRETKEY]\n",
     "tenants[1].keys[0]"),
    ("tenants:\n  - name: a\n    keys: [SECRETKEY]\n  - name: a\n    keys: [other]\n",
     "tenants[1].name"),
    ("tenants:\n  - name: a b\n    keys: [SECRETKEY]\n", "tenants[0].name"),
    ("tenants:\n  - name: a\n    keys: [k]\n    SECRETKEY: [x]\n",
     "tenants[0]: an unknown field"),
    ("tenants: []\n", "tenants"),
    ("tenants:\n  - name: a\n    keys: [SECRETKEY\n", "not valid YAML at line"),
])
def test_a_bad_keys_file_names_the_field_and_never_the_key(tmp_path, text, field):
    with pytest.raises(ValueError) as info:
        load_tenants(keys_file(tmp_path, text))
    assert field in str(info.value) and "SECRETKEY" not in str(info.value)


def test_the_cli_reads_the_keys_file_and_the_internal_token(tmp_path, monkeypatch):
    path = keys_file(tmp_path, f"tenants:\n  - name: team-a\n    keys: ['{SECRET}']\n")
    monkeypatch.setenv("BATON_API_KEYS_FILE", path)
    monkeypatch.setenv("BATON_INTERNAL_TOKEN", "internal-token-0123456789")
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    args = build_parser().parse_args(["router", "--workers", "http://w:1",
                                      "--header-timeout", "3"])
    settings = _router_settings(args)
    assert [t.name for t in settings.tenants] == ["team-a"]
    assert settings.internal_token == "internal-token-0123456789"
    assert settings.header_timeout_s == 3 and settings.otlp_endpoint is None
    monkeypatch.setenv("BATON_API_KEY", SECRET)  # the same key twice: refused, unnamed
    with pytest.raises(ValueError, match="tenants\\[0\\].keys") as info:
        _router_settings(args)
    assert SECRET not in str(info.value)


def test_a_token_bucket_refills_and_says_how_long_to_wait():
    bucket = TokenBucket(rate=2.0, capacity=2.0, now=0.0)
    assert bucket.take(1, 0.0) == 0.0 and bucket.take(1, 0.0) == 0.0
    assert bucket.take(1, 0.0) == pytest.approx(0.5)  # refused: nothing taken
    assert bucket.take(1, 0.5) == 0.0
    assert bucket.take(5, 1.5) == 0.0 and bucket.level == pytest.approx(-3.0)  # in debt
    assert bucket.take(1, 2.0) == pytest.approx(1.5)
    bucket.adjust(-10, 2.0)  # a refund never overfills
    assert bucket.level == 2.0


async def answer(pod: FakePod, request: web.Request, body: bytes):
    return web.json_response({"id": "c", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})


def test_keys_tenants_and_their_limits_at_the_router(caplog):
    tenants = (TenantSpec(name="team-a", keys=(SECRET,), requests_per_second=1),
               TenantSpec(name="team-b", keys=("sk-b",), tokens_per_minute=100))

    async def main():
        router, pods = await start(FakePod("both", answer), tenants=tenants,
                                   api_key="sk-default")
        status, _, body = await post(router, chat())
        assert status == 401 and "invalid_api_key" in body and len(pods[0].bodies) == 0
        status, _, _ = await post(router, chat(), Authorization="Bearer nope")
        assert status == 401
        assert (await post(router, chat(), Authorization=f"Bearer {SECRET}"))[0] == 200
        status, headers, body = await post(router, chat(), Authorization=f"Bearer {SECRET}")
        assert status == 429 and headers["Retry-After"] == "1"
        assert "rate_limit_error" in body and "requests_per_second" in body
        assert len(pods[0].bodies) == 1  # refused before it reached a worker
        # tokens: the prompt (~8) + 90 fit a 100-token minute once; the answer's usage (6)
        # then replaces the charge: 94 left, enough for ~8 + 80 but not for ~8 + 90
        big = chat(max_tokens=90)
        assert (await post(router, big, Authorization="Bearer sk-b"))[0] == 200
        assert (await post(router, big, Authorization="Bearer sk-b"))[0] == 429
        assert (await post(router, chat(max_tokens=80), Authorization="Bearer sk-b"))[0] \
            == 200
        assert (await post(router, chat(), Authorization="Bearer sk-default"))[0] == 200
        for code, tenant, count in [("200", "team-a", 1), ("429", "team-a", 1),
                                    ("200", "team-b", 2), ("429", "team-b", 1),
                                    ("200", "default", 1)]:
            assert metric(router, "baton:router_requests_total", code=code,
                          tenant=tenant) == count
        assert metric(router, "baton:router_rate_limited_total", tenant="team-b",
                      limit="tokens_per_minute") == 1
        await stop(router, pods)
    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    assert SECRET not in caplog.text and "sk-b" not in caplog.text


def test_with_keys_workers_needs_one_and_probes_stay_open():
    async def main():
        router, pods = await start(FakePod("both", answer), api_key="sk-default")
        async with aiohttp.ClientSession() as session:
            for path, status in [("/workers", 401), ("/v1/models", 401), ("/health", 200),
                                 ("/ready", 200), ("/metrics", 200)]:
                async with session.get(router.make_url(path)) as resp:
                    assert resp.status == status, path
            async with session.get(router.make_url("/workers"),
                                   headers={"Authorization": "Bearer sk-default"}) as resp:
                assert resp.status == 200
                assert (await resp.json())["workers"][0]["url"] == pods[0].url
        await stop(router, pods)
    asyncio.run(main())


class ContextPod(FakePod):
    """A worker with a 128-token context window: it refuses a request whose `max_tokens`
    does not fit (400, as a real worker), and streams an answer without a usage event."""

    async def _load(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "role": "both", "model": "m",
                                  "max_model_len": 128})


async def refuse_or_stream(pod: FakePod, request: web.Request, body: bytes):
    req = json.loads(body)
    if req.get("max_tokens", 0) > 1000 and not req.get("stream"):
        return web.json_response({"error": {"message": "max_tokens exceed the context",
                                            "type": "invalid_request_error"}}, status=400)
    if not req.get("stream"):
        return web.json_response({"id": "c", "choices": []})
    return await stream(request, content("hi"), content("", "length"), b"data: [DONE]\n\n")


def test_a_huge_max_tokens_never_locks_its_tenant_out():
    """Charged at most what the context leaves (a stream without usage keeps its charge),
    and a refused request gets its charge back: the tenant's next requests go through."""
    tenants = (TenantSpec(name="team-b", keys=("sk-b",), tokens_per_minute=300),)

    async def main():
        router, pods = await start(ContextPod("both", refuse_or_stream), tenants=tenants)
        key = {"Authorization": "Bearer sk-b"}
        for _ in range(3):  # refused by the worker: nothing used, nothing kept
            assert (await post(router, chat(max_tokens=1_000_000), **key))[0] == 400
        assert (await post(router, chat(max_tokens=10), **key))[0] == 200
        # a stream asking a million: charged the 128-token window less the prompt, not 1e6
        assert (await post(router, chat(max_tokens=1_000_000, stream=True), **key))[0] == 200
        assert (await post(router, chat(max_tokens=10), **key))[0] == 200
        await stop(router, pods)
    asyncio.run(main())


def test_workers_are_told_the_callers_tenant():
    """Each call to a worker names the caller's tenant (`X-Baton-Tenant`): the worker's
    fair share of its waiting queue is per tenant."""
    tenants = (TenantSpec(name="team-a", keys=(SECRET,)),)

    async def main():
        router, pods = await start(FakePod("both", answer), tenants=tenants,
                                   api_key="sk-default")
        assert (await post(router, chat(), Authorization=f"Bearer {SECRET}"))[0] == 200
        assert (await post(router, chat(), Authorization="Bearer sk-default"))[0] == 200
        assert [h["X-Baton-Tenant"] for h in pods[0].headers] == ["team-a", "default"]
        await stop(router, pods)
    asyncio.run(main())
