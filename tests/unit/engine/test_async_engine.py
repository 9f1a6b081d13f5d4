"""The asyncio front: concurrent streams, deltas add up, abort frees blocks, and the event
loop keeps running while the engine steps."""

from __future__ import annotations

import asyncio

import pytest

from baton import LLM, SamplingParams
from baton.engine.async_engine import AsyncEngine
from baton.engine.config import EngineConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineConfig.from_args(dtype="float32", num_kv_blocks=256))
    yield eng
    eng.shutdown()


def test_streams_match_offline_and_loop_stays_responsive(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ["Once upon a time", "The best way to learn is",
                                       "Paris is", "def add(a, b):"]]
    params = SamplingParams(temperature=0, max_tokens=16)

    async def one(i, ids):
        deltas, last = [], None
        async for out in engine.generate(ids, params, f"s{i}"):
            deltas.append(out.outputs[0].delta_text)
            last = out
        assert "".join(deltas) == last.outputs[0].text
        return last.outputs[0].token_ids

    async def ticker(stop):
        ticks = 0
        while not stop.is_set():
            await asyncio.sleep(0.005)
            ticks += 1
        return ticks

    async def main():
        stop = asyncio.Event()
        tick_task = asyncio.create_task(ticker(stop))
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        stop.set()
        return results, await tick_task

    results, ticks = asyncio.run(main())
    assert ticks > 5  # the event loop ran while the engine worked
    offline = LLM(dtype="float32", num_kv_blocks=256).generate(
        [list(p) for p in prompts], params, use_tqdm=False)
    assert results == [o.outputs[0].token_ids for o in offline]


def test_abandoned_stream_is_aborted_and_frees_blocks(engine):
    ids = engine.tokenizer.encode("Tell me a long story about a dragon.")

    async def main():
        agen = engine.generate(ids, SamplingParams(temperature=0, max_tokens=200,
                                                   ignore_eos=True), "abandon")
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not engine.core.has_unfinished_requests():
                break

    asyncio.run(main())
    assert engine.core.kv.num_used_blocks == 0
    engine.core.check_integrity()


def test_invalid_request_raises_in_the_caller(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], SamplingParams(), "bad"):
                pass

    asyncio.run(main())
