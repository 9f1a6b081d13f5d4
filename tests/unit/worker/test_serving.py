"""The engine side of serving over a scripted engine: jobs, admission, merged output
batches and the request metrics."""

from __future__ import annotations

import asyncio

import pytest

from baton.common.errors import OpenAIError
from baton.common.sampling_params import SamplingParams
from tests.unit.worker.fakes import FakeEngine, kv_params, make_pipeline, out

PARAMS = SamplingParams(max_tokens=4, seed=7, n=2)


def sample(metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


def make_serving(engine: FakeEngine | None = None, max_waiting: int = 8):
    pipeline, engine, metrics = make_pipeline(engine, max_waiting)
    return pipeline.serving, engine, metrics


def test_jobs_fan_out_n_per_prompt_with_distinct_seeds():
    serving, engine, _ = make_serving()
    jobs = serving.make_jobs("r", [[1, 2], [3]], PARAMS, "prompt")
    assert [(j.index, j.request_id, j.prompt_ids) for j in jobs] == [
        (0, "r-0", [1, 2]), (1, "r-1", [1, 2]), (2, "r-2", [3]), (3, "r-3", [3])]
    assert [r.params.seed for r in engine.made] == [7, 8, 7, 8]
    assert engine.submitted == []  # built, not queued


@pytest.mark.parametrize("prompt, max_tokens, param", [(list(range(64)), None, "prompt"),
                                                       (list(range(60)), 8, "max_tokens")])
def test_a_prompt_beyond_the_context_window_is_a_400_and_nothing_is_made(prompt, max_tokens,
                                                                          param):
    serving, engine, _ = make_serving()
    with pytest.raises(OpenAIError) as err:
        serving.make_jobs("r", [[1], prompt], SamplingParams(max_tokens=max_tokens), "prompt")
    assert err.value.status == 400 and err.value.param == param
    assert err.value.code == "context_length_exceeded"
    assert err.value.message.startswith("this model's maximum context length is 64 tokens")
    assert engine.made == []


def test_an_invalid_engine_request_is_a_400_naming_the_param():
    serving, _, _ = make_serving()
    with pytest.raises(OpenAIError) as err:
        serving.make_jobs("r", [[]], SamplingParams(), "messages")
    assert (err.value.status, err.value.param) == (400, "messages")


def test_admission_is_all_or_nothing_with_429_when_the_queue_is_full():
    serving, engine, metrics = make_serving(FakeEngine(num_waiting=7), max_waiting=8)
    jobs = serving.make_jobs("r", [[1]], PARAMS, "prompt")
    with pytest.raises(OpenAIError) as err:
        serving.admit(jobs)
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "1"}
    assert engine.submitted == []
    assert sample(metrics, "baton:requests_rejected_total", reason="queue_full") == 1


def test_run_merges_the_jobs_and_records_latencies():
    coalesced = lambda r: [[out(r.request_id, [1], queue_time=0.25)],  # noqa: E731
                           [out(r.request_id, [2]), out(r.request_id, [3, 4])],
                           [out(r.request_id, [], finish="stop", queue_time=0.25)]]
    serving, _, metrics = make_serving(FakeEngine(coalesced))
    jobs = serving.make_jobs("r", [[1]], PARAMS, "prompt")
    serving.admit(jobs)

    async def main():
        return [(job.index, len(batch)) async for job, batch in serving.run(jobs)]

    updates = asyncio.run(main())
    assert sorted(updates) == [(0, 1), (0, 1), (0, 2), (1, 1), (1, 1), (1, 2)]
    assert sample(metrics, "baton:time_to_first_token_seconds_count") == 2
    # one gap for the batch of 3 tokens, and a zero for each of the 2 that came with it
    assert sample(metrics, "baton:inter_token_latency_seconds_count") == 2 * 3
    assert sample(metrics, "baton:e2e_request_latency_seconds_count") == 2
    assert sample(metrics, "baton:queue_time_seconds_sum") == 0.5
    assert sample(metrics, "baton:requests_total", finish_reason="stop") == 2
    assert all(j.first_token.queue_s == 0.25 for j in jobs)


def test_leaving_early_aborts_every_job_and_counts_them():
    unfinished = lambda r: [[out(r.request_id, [10])]]  # noqa: E731 - then nothing
    serving, engine, metrics = make_serving(FakeEngine(unfinished))
    jobs = serving.make_jobs("r", [[1]], PARAMS, "prompt")
    serving.admit(jobs)

    async def main():
        updates = serving.run(jobs)
        await anext(updates)
        await updates.aclose()

    asyncio.run(main())
    assert sorted(engine.aborted) == ["r-0", "r-1"]
    assert sample(metrics, "baton:requests_total", finish_reason="abort") == 2


def test_the_held_kv_of_a_prefill_is_on_its_job():
    params = kv_params(2)
    serving, _, _ = make_serving(FakeEngine(lambda r: [[out(
        r.request_id, [5], finish="length", kv_transfer_params=params)]]))
    jobs = serving.make_jobs("p", [[1, 2]], SamplingParams(max_tokens=1), "prompt")
    serving.admit(jobs)

    async def main():
        return [u async for u in serving.run(jobs)]

    asyncio.run(main())
    assert jobs[0].kv_transfer_params == params and jobs[0].finish_reason == "length"


def test_a_dead_engine_is_a_503_before_anything_is_queued():
    serving, engine, _ = make_serving(FakeEngine(dead_error=RuntimeError("x")))
    with pytest.raises(OpenAIError) as err:
        serving.admit(serving.make_jobs("r", [[1]], SamplingParams(), "prompt"))
    assert err.value.status == 503 and engine.submitted == []


def test_a_request_larger_than_the_whole_queue_is_a_400_not_a_429():
    """No wait would ever let 12 sequences into a queue of 8: a retry loop must not start."""
    serving, engine, metrics = make_serving(max_waiting=8)
    jobs = serving.make_jobs("r", [[1]] * 6, PARAMS, "prompt")  # 6 prompts x n=2
    with pytest.raises(OpenAIError) as err:
        serving.admit(jobs)
    assert err.value.status == 400 and err.value.code == "too_many_sequences"
    assert "queues at most 8" in err.value.message and not err.value.headers
    assert engine.submitted == []
    assert sample(metrics, "baton:requests_rejected_total", reason="queue_full") == 0


@pytest.mark.parametrize("header", ["router_queue=nan", "prefill=1e999", "prefill=-1",
                                    "router_queue=inf,prefill=0", "x=1", "a=1,b=2,c=3",
                                    "prefill"])
def test_timing_headers_that_are_not_finite_seconds_are_a_400(header):
    from baton.worker.pipeline import parse_timing

    with pytest.raises(OpenAIError) as err:
        parse_timing(header)
    assert err.value.status == 400 and "X-Baton-Timing" in err.value.message


def test_the_routers_timing_header_parses():
    from baton.worker.pipeline import parse_timing

    assert parse_timing("router_queue=0.001500,prefill=0.250000") == {
        "router_queue": 0.0015, "prefill": 0.25}
    assert parse_timing("1") == {}


def test_a_tenant_within_its_share_is_admitted_while_another_fills_the_queue():
    """Tenant a fills the queue of 4; b still gets its share (4 // 2 = 2), a gets a 429, and
    a lone tenant sees the plain queue limit."""
    serving, engine, metrics = make_serving(max_waiting=4)
    one = SamplingParams(max_tokens=4)

    def jobs(rid: str, n: int = 1):
        return serving.make_jobs(rid, [[1]] * n, one, "prompt")

    flood = jobs("a0", 4)
    serving.admit(flood, "a")
    engine.num_waiting = 4  # the queue is full of a's
    for tenant in ("a", "a"):  # alone, a sees the queue limit
        with pytest.raises(OpenAIError) as err:
            serving.admit(jobs("a1"), tenant)
        assert err.value.status == 429
    serving.admit(jobs("b0"), "b")
    serving.admit(jobs("b1"), "b")
    for tenant in ("b", "a"):  # b at its share of 2; a far over it
        with pytest.raises(OpenAIError) as err:
            serving.admit(jobs("x"), tenant)
        assert err.value.status == 429
    for job in flood:  # a's requests finish: they no longer count
        job.request.finished = True
    assert serving.fair_share.in_flight() == {"b": 2}
