"""`--stream-interval` (`worker.coalesce`): a stream's tokens leave in SSE chunks of at
least N tokens, its first and its last at once, text and token ids in order."""

from __future__ import annotations

import asyncio

from baton.worker import openai_api
from baton.worker.coalesce import coalesced
from tests.unit.worker.fakes import FakeEngine, make_pipeline, out
from tests.unit.worker.test_openai_api import PROMPT, completion_request


def _chunks(script, interval: int, n: int = 1):
    pipeline, _, _ = make_pipeline(FakeEngine(script))
    serving, req = pipeline.serving, completion_request(stream=True, n=n)

    async def main():
        jobs = serving.make_jobs("r", [PROMPT], req.to_sampling_params(), "prompt")
        answer = pipeline.format.answer("completion", req, "r", [PROMPT], len(jobs),
                                        openai_api.PUBLIC)
        serving.admit(jobs)
        updates = coalesced(serving.run(jobs), interval)
        return [c async for c in openai_api.events(answer, updates)]
    return asyncio.run(main())


def _texts(chunks: list[bytes]) -> list[list[str]]:
    import json

    events = [json.loads(line[5:]) for c in chunks for line in c.split(b"\n\n")
              if line.startswith(b"data: {")]
    return [[ch["text"] for ch in e["choices"]] for e in events]


def one_token_a_step(r):
    steps = [[out(r.request_id, [10 + i])] for i in range(7)]
    return steps + [[out(r.request_id, [20], finish="length")]]


def test_tokens_leave_in_chunks_of_the_interval_the_first_and_last_at_once():
    assert _texts(_chunks(one_token_a_step, 1)) == [
        [f"<{10 + i}>"] for i in range(7)] + [["<20>"]]
    assert _texts(_chunks(one_token_a_step, 3)) == [
        ["<10>"], ["<11><12><13>"], ["<14><15><16>"], ["<20>"]]
    assert _texts(_chunks(one_token_a_step, 5)) == [
        ["<10>"], ["<11><12><13><14><15>"], ["<16><20>"]]  # the rest with the finish


def test_each_choice_is_held_back_on_its_own():
    chunks = _texts(_chunks(one_token_a_step, 4, n=2))
    assert sorted(chunks) == sorted([["<10>"], ["<11><12><13><14>"], ["<15><16><20>"]] * 2)
