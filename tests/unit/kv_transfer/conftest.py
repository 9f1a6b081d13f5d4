"""The transport fixtures of the conformance suite: every installed transport, built by name."""

from __future__ import annotations

import os
import uuid

import pytest

from baton.kv_transfer import TRANSPORTS, make_transport, unavailable


@pytest.fixture(params=TRANSPORTS)
def kind(request):
    if why := unavailable(request.param):
        if request.param == "nixl" and os.environ.get("BATON_REQUIRE_NIXL") == "1":
            pytest.fail(f"{why}, but BATON_REQUIRE_NIXL=1")
        pytest.skip(why)
    return request.param


@pytest.fixture
def make(kind):
    """make(kv, name=None, **transport kwargs) -> (transport, endpoint), closed after."""
    made = []

    def _make(kv, name=None, **kwargs):
        t = make_transport(kind, **kwargs)
        ep = t.start(kv, name or f"engine-{uuid.uuid4().hex[:8]}")
        made.append(t)
        return t, ep

    yield _make
    for t in made:
        t.close()
