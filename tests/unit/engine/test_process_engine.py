"""The engine core in its own process (`ProcessEngine`): the same outputs as the core on a
thread (greedy, stop strings, logprobs, a grammar compiled in the core), requests checked
in the front before anything crosses, aborts and stats across the channel, and a core that
dies failing every stream instead of hanging one."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from baton import SamplingParams
from baton.common.registry import DEVICE, HOST
from baton.common.sampling_params import StructuredOutput
from baton.engine.async_engine import AsyncEngine, EngineDeadError
from baton.engine.config import EngineConfig, EngineProcess
from baton.engine.errors import InvalidRequestError
from baton.engine.process_engine import PoolMirror, ProcessEngine, core_apart

pytestmark = pytest.mark.slow

CONFIG = {"dtype": "float32", "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def engines():
    apart, here = ProcessEngine(EngineConfig.from_args(**CONFIG)), None
    try:
        apart.start()
        here = AsyncEngine(EngineConfig.from_args(**CONFIG))
        yield apart, here
    finally:
        apart.shutdown()
        if here is not None:
            here.shutdown()
    assert apart._proc.returncode == 0  # noqa: SLF001 - the core stopped cleanly


async def _run(engine, ids, params, rid):
    last = None
    async for out in engine.generate(ids, params, rid):
        last = out
    return last.outputs[0]


def test_outputs_match_the_core_on_a_thread(engines):
    apart, here = engines
    tok = apart.tokenizer
    cases = [("Once upon a time", SamplingParams(temperature=0, max_tokens=16)),
             ("The best way to learn is", SamplingParams(temperature=0, max_tokens=24,
                                                         stop=["."])),
             ("Paris is", SamplingParams(temperature=0, max_tokens=8, logprobs=2)),
             ("def add(a, b):", SamplingParams(temperature=0.8, seed=7, max_tokens=12))]

    async def both():
        runs = [_run(e, tok.encode(p), params, f"{name}-{i}")
                for name, e in (("apart", apart), ("here", here))
                for i, (p, params) in enumerate(cases)]
        return await asyncio.gather(*runs)

    outs = asyncio.run(both())
    for a, b in zip(outs[:len(cases)], outs[len(cases):], strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == b.logprobs
    assert outs[1].finish_reason == "stop" and outs[2].logprobs is not None


def test_a_grammar_is_compiled_and_followed_in_the_core(engines):
    apart, _ = engines
    params = SamplingParams(temperature=0, max_tokens=12,
                            structured=StructuredOutput("regex", "(yes|no) [0-9]{3}"))

    async def go():
        await apart.compile_grammar(params.structured)  # the front's check, off the loop
        return await _run(apart, apart.tokenizer.encode("Answer:"), params, "grammar")

    out = asyncio.run(go())
    assert out.text.split()[0] in ("yes", "no") and out.text.split()[1].isdigit()


def test_a_bad_request_is_refused_before_it_crosses(engines):
    apart, _ = engines
    with pytest.raises(InvalidRequestError):
        apart.make_request("bad", [apart.tokenizer.vocab_size + 10], SamplingParams())
    with pytest.raises(InvalidRequestError):
        apart.make_request("long", [1] * (apart.max_model_len + 1), SamplingParams())
    assert apart.num_waiting == 0


def test_an_abort_frees_the_cores_blocks_and_the_stats_say_so(engines):
    apart, _ = engines

    async def go():
        req = apart.make_request("long", apart.tokenizer.encode("Count: 1, 2, 3,"),
                                 SamplingParams(max_tokens=400, ignore_eos=True))
        batches = apart.stream("long", apart.submit(req))
        async for batch in batches:
            if sum(len(o.new_token_ids) for o in batch):
                break
        await batches.aclose()  # leaving the stream aborts it
        assert req.is_finished  # the front's copy ends with it (fair admission reads it)
        for _ in range(50):
            await apart.sync_stats()
            stats = apart.stats()
            if stats.running == 0 and stats.kv_blocks_used == 0:
                return stats
            await asyncio.sleep(0.05)
        raise AssertionError(f"the core still holds the aborted request: {apart.stats()}")

    stats = asyncio.run(go())
    assert stats.generation_tokens_total > 0 and apart.num_waiting == 0
    assert not asyncio.run(apart.release_lease("no-such-lease"))  # no connector: False


def test_where_the_core_runs():
    sim = {"device": "sim", "sim_profile": "h100-llama3-8b"}
    assert core_apart(EngineConfig.from_args(**sim), EngineProcess.AUTO)
    assert not core_apart(EngineConfig.from_args(device="cpu"), EngineProcess.AUTO)
    assert core_apart(EngineConfig.from_args(device="cpu"), EngineProcess.ON)
    assert not core_apart(EngineConfig.from_args(**sim), EngineProcess.OFF)
    lora = EngineConfig.from_args(**sim, enable_lora=True)
    assert not core_apart(lora, EngineProcess.AUTO)  # a LoRA-serving core stays on a thread
    with pytest.raises(ValueError, match="LoRA"):
        ProcessEngine(lora)  # refused before anything starts


def test_the_pool_mirror_follows_block_events():
    mirror = PoolMirror()
    mirror.record_events()
    mirror.apply([(True, 1, DEVICE), (True, 2, DEVICE), (True, 2, HOST), (False, 1, DEVICE)])
    assert sorted(mirror.held_hashes()) == [(2, DEVICE), (2, HOST)]
    mirror.apply([(False, None, DEVICE), (True, 3, DEVICE)])  # the pool was reset
    assert sorted(mirror.held_hashes()) == [(2, HOST), (3, DEVICE)]
    assert mirror.events_appended == 6 and len(mirror.events) == 6


def test_a_core_that_dies_fails_every_stream():
    engine = ProcessEngine(EngineConfig.from_args(device="sim", sim_profile="h100-llama3-8b"))
    engine.start()
    try:
        async def go():
            streams = [engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=5000,
                                                                    ignore_eos=True), f"r{i}")
                       for i in range(3)]
            first = [await anext(s) for s in streams]
            assert all(f.outputs[0].token_ids for f in first)
            os.kill(engine._proc.pid, signal.SIGKILL)  # noqa: SLF001
            for s in streams:
                with pytest.raises(EngineDeadError):
                    async with asyncio.timeout(30):
                        async for _ in s:
                            pass

        asyncio.run(go())
        assert engine.dead_error is not None and not engine.is_alive
        with pytest.raises(EngineDeadError):
            asyncio.run(_run(engine, [1, 2], SamplingParams(max_tokens=2), "after"))
    finally:
        engine.shutdown()
