"""Workers behind an internal token: /internal/* needs it, /v1 needs an API key (or the
token, a router's call) once keys are set; probes stay open. Keys and tokens are compared
in constant time and never echoed."""

from __future__ import annotations

import asyncio

import pytest

from baton.common.auth import TOKEN_HEADER, internal_token
from baton.common.internal import WORKER_HEADER, worker_header
from baton.common.roles import Role
from baton.worker.app import build_app
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.worker.fakes import MODEL, asgi_call, make_pipeline

TOKEN = "t" * 32
KEY = "sk-client-key"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def make_app(**settings):
    state = WorkerState(WorkerSettings(role=Role.PREFILL, **settings))
    state.pipeline, state.engine, _ = make_pipeline()
    return build_app(state.settings, state)


def call(app, method, path, body=None, **headers):
    return asyncio.run(asgi_call(app, method, path, body, headers))


def test_internal_endpoints_need_the_token():
    app = make_app(internal_token=TOKEN)
    prefill = {"api": "chat", "request": CHAT}
    code, _, raw = call(app, "POST", "/internal/prefill", prefill)
    assert code == 401 and TOKEN.encode() not in raw
    assert call(app, "POST", "/internal/prefill", prefill, **{TOKEN_HEADER: "wrong" * 8})[0] == 401
    assert call(app, "POST", "/internal/prefill", prefill, **{TOKEN_HEADER: TOKEN})[0] != 401
    assert call(app, "GET", "/health")[0] == 200  # probes stay open
    assert call(app, "POST", "/v1/chat/completions", CHAT)[0] == 200  # no keys: /v1 open


def test_v1_needs_a_key_or_the_internal_token_once_keys_are_set():
    app = make_app(internal_token=TOKEN, api_keys=(KEY,))
    assert call(app, "POST", "/v1/chat/completions", CHAT)[0] == 401
    assert call(app, "POST", "/v1/chat/completions", CHAT,
                Authorization="Bearer nope")[0] == 401
    assert call(app, "POST", "/v1/chat/completions", CHAT,
                Authorization=f"Bearer {KEY}")[0] == 200
    assert call(app, "POST", "/v1/chat/completions", CHAT, **{TOKEN_HEADER: TOKEN})[0] == 200
    assert call(app, "GET", "/health")[0] == 200


def test_the_token_comes_from_the_environment_or_a_file(tmp_path):
    assert internal_token({}) is None
    assert internal_token({"BATON_INTERNAL_TOKEN": TOKEN}) == TOKEN
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert internal_token({"BATON_INTERNAL_TOKEN_FILE": str(path)}) == TOKEN
    with pytest.raises(ValueError, match="at least"):
        internal_token({"BATON_INTERNAL_TOKEN": "short"})
    with pytest.raises(ValueError, match="cannot read"):
        internal_token({"BATON_INTERNAL_TOKEN_FILE": str(tmp_path / "missing")})
    assert TOKEN not in repr(WorkerSettings(internal_token=TOKEN, api_keys=(KEY,)))


def test_a_tenant_is_believed_only_from_a_router(monkeypatch):
    """`X-Baton-Tenant` names the caller's tenant for the worker's fair share; from a caller
    without the internal token it is dropped (tenant `default`)."""
    from baton.worker.serving import Serving

    seen: list[str] = []
    admit = Serving.admit
    monkeypatch.setattr(Serving, "admit",
                        lambda self, jobs, tenant="default": (seen.append(tenant),
                                                              admit(self, jobs, tenant))[1])
    app = make_app(internal_token=TOKEN)
    given = {"X-Baton-Tenant": "team-a"}
    assert call(app, "POST", "/v1/chat/completions", CHAT, **given)[0] == 200
    assert call(app, "POST", "/v1/chat/completions", CHAT,
                **given, **{TOKEN_HEADER: TOKEN})[0] == 200
    assert seen == ["default", "team-a"]


def test_every_answer_names_the_worker_refusals_included():
    """X-Baton-Worker: the router believes only answers that name a Baton worker of its wire
    version, and the registry's record of it (`router/answers.py`)."""
    state = WorkerState(WorkerSettings(role=Role.PREFILL, internal_token=TOKEN))
    state.pipeline, state.engine, _ = make_pipeline()
    app = build_app(state.settings, state)
    for method, path, body in [("GET", "/health", None), ("POST", "/v1/chat/completions", CHAT),
                               ("POST", "/internal/prefill", {})]:  # the last one a 401
        _, headers, _ = call(app, method, path, body)
        assert headers[WORKER_HEADER.lower()] == worker_header(state.worker_id)
