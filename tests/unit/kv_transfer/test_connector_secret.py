"""The secret from `EngineConfig.kv_secret` through `TransportKVConnector` to the transport:
a decode engine whose secret differs from its prefill's fails the pull with a reason and
falls back by its `kv_failure_policy`; the lease id it is handed is never the request id."""

from __future__ import annotations

import time

import pytest

from baton.common.sampling_params import SamplingParams
from baton.engine.config import EngineConfig, LiveKVSettings
from baton.engine.kv_connector import HoldKV, PullKV
from baton.engine.kv_connector.transport import TransportKVConnector
from baton.engine.request import Request, RequestStatus
from tests.unit.kv_transfer.factories import OTHER_SECRET, SECRET, cache


def test_engine_config_validates_and_hides_the_secret():
    assert EngineConfig().kv_transfer.secret is None
    assert SECRET not in repr(EngineConfig.from_args(kv_secret=SECRET))
    with pytest.raises(ValueError, match="kv_secret") as err:
        EngineConfig.from_args(kv_secret="short-secret")
    assert "short-secret" not in str(err.value)


def connector(secret, policy="recompute", kv=None) -> TransportKVConnector:
    live = LiveKVSettings(lease_ttl_s=30, transfer_timeout_s=5, failure_policy=policy)
    return TransportKVConnector("tcp", cache() if kv is None else kv, None, live,
                                secret=secret)


def held(prefill: TransportKVConnector, rid: str):
    req = Request(rid, list(range(8)), SamplingParams(max_tokens=1), max_tokens=1,
                  kv_handoff=HoldKV(), output_token_ids=[5],
                  status=RequestStatus.FINISHED_LENGTH_CAPPED)
    keep, params = prefill.request_finished(req, [3, 4])
    assert keep and params is not None
    return params


def pulled(decode: TransportKVConnector, params, rid: str):
    req = Request(rid, list(range(8)), SamplingParams(max_tokens=4), max_tokens=4,
                  kv_handoff=PullKV(params))
    decode.start_load(req, [0, 1], 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        updates = decode.poll()
        if updates.loaded or updates.recompute or updates.failed:
            return updates
        time.sleep(0.005)
    raise AssertionError("the pull never ended")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_decode_engine_with_another_secret_falls_back(policy):
    prefill, decode = connector(SECRET), connector(OTHER_SECRET, policy)
    try:
        params = held(prefill, "client-chosen-id")
        assert "client-chosen-id" not in params.lease_id and len(params.lease_id) >= 22
        updates = pulled(decode, params, "d1")
        if policy == "recompute":
            assert [r.request_id for r in updates.recompute] == ["d1"]
            assert decode.stats.fallbacks == {"kv_auth": 1}
        else:
            [(req, reason)] = updates.failed
            assert req.request_id == "d1" and "secrets differ" in reason
        assert prefill.num_leases_held == 1  # the lease is still there for a real peer
    finally:
        prefill.close()
        decode.close()


def test_matching_secrets_move_the_blocks():
    src = cache()
    prefill, decode = connector(SECRET, kv=src), connector(SECRET)
    try:
        params = held(prefill, "p1")
        updates = pulled(decode, params, "d1")
        assert [r.request_id for r in updates.loaded] == ["d1"]
        assert decode.stats.failures == 0
    finally:
        prefill.close()
        decode.close()
