"""No request can kill the engine: a request whose own settings make sampling raise ends
alone (finish reason "error"), the requests batched with it go on, and the engine takes new
work; a step failing as a whole ends its requests, and only repeated failures are the
engine's (EngineStepError). The real bundled model and the real sampler."""

from __future__ import annotations

import pytest

from baton import SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core import MAX_FAILED_STEPS, EngineCore, EngineStepError
from baton.engine.errors import InvalidRequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def core():
    return EngineCore(EngineConfig.from_args(dtype="float32", num_kv_blocks=128, max_num_seqs=8))


def run(core: EngineCore, max_steps: int = 200) -> dict[str, list]:
    """Step until idle; each request's outputs."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not core.has_unfinished_requests()
    return outs


def add(core: EngineCore, rid: str, params: SamplingParams) -> None:
    core.add(core.make_request(rid, core.tokenizer.encode("Once upon a time"), params))


def test_a_seed_torch_refuses_ends_that_request_alone(core):
    bad = SamplingParams(temperature=1.0, max_tokens=8)
    bad.seed = 1 << 64  # past validation, as a bug elsewhere might let it: torch overflows
    add(core, "poison", bad)
    add(core, "good-sampled", SamplingParams(temperature=1.0, seed=3, max_tokens=8))
    add(core, "good-greedy", SamplingParams(temperature=0, max_tokens=8))
    outs = run(core)
    assert outs["poison"][-1].finish_reason == "error"
    assert "seed" in str(outs["poison"][-1].stop_reason)
    for rid in ("good-sampled", "good-greedy"):
        assert outs[rid][-1].finish_reason == "length"
        assert sum(len(o.new_token_ids) for o in outs[rid]) == 8
    assert core.kv.num_used_blocks == 0
    add(core, "after", SamplingParams(temperature=0, max_tokens=4))
    assert run(core)["after"][-1].finish_reason == "length"


def test_a_banned_id_outside_the_vocabulary_ends_that_request_alone(core):
    bad = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    bad.stop_token_ids = [10**6]  # past the engine's own check
    req = core.make_request("bad-ban", core.tokenizer.encode("Hello"),
                            SamplingParams(temperature=0, max_tokens=4))
    req.sampling_params = bad
    core.add(req)
    add(core, "fine", SamplingParams(temperature=0, max_tokens=4))
    outs = run(core)
    assert outs["bad-ban"][-1].finish_reason == "error"
    assert outs["fine"][-1].finish_reason == "length"


def test_the_edge_refuses_what_the_sampler_could_not_take(core):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=1 << 64)
    with pytest.raises(InvalidRequestError, match="stop_token_ids") as err:
        core.make_request("x", [1, 2, 3], SamplingParams(stop_token_ids=[10**6], min_tokens=2))
    assert err.value.param == "stop_token_ids"


def test_a_failing_step_ends_its_requests_and_repeated_failures_are_the_engines(
        core, monkeypatch):
    execute = core.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step fault")
        return execute(*args, **kwargs)

    monkeypatch.setattr(core.runner, "execute", flaky)
    add(core, "a", SamplingParams(temperature=0, max_tokens=4))
    add(core, "b", SamplingParams(temperature=0, max_tokens=4))
    outs = run(core)
    assert [outs[r][-1].finish_reason for r in "ab"] == ["error", "error"]
    add(core, "c", SamplingParams(temperature=0, max_tokens=4))  # one failure: goes on
    assert run(core)["c"][-1].finish_reason == "length"
    assert core.kv.num_used_blocks == 0

    monkeypatch.setattr(core.runner, "execute", lambda *a, **k: 1 / 0)
    with pytest.raises(EngineStepError):
        for i in range(MAX_FAILED_STEPS):
            add(core, f"d{i}", SamplingParams(temperature=0, max_tokens=4))
            run(core)
