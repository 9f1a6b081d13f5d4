"""The queueing simulation: exact on hand-checkable traces, monotone in replicas and load,
deterministic for a seed."""

from __future__ import annotations

import numpy as np
import pytest

from baton.planner.simulate import (
    LengthDist,
    SimSettings,
    Trace,
    Workload,
    batched_prefill,
    draw_trace,
    simulate,
    simulate_prefill,
    weighted_percentile,
)
from tests.unit.planner.factories import make_profile, make_workload

PROFILE = make_profile(a=0.01, b=1e-4, c=0.02, d=1e-3, e=1e-6)
SETTINGS = SimSettings(chunk_tokens=2048, max_num_seqs=128, transfer_s=0.005, percentile=50)


def trace(arrivals, prompt, output) -> Trace:
    return Trace(np.array(arrivals, float), np.array(prompt), np.array(output))


def test_one_request_alone_gets_exactly_its_service_times():
    t = trace([0.0], [1000], [4])
    r = simulate(t, 1, 1, PROFILE, SETTINGS)
    assert r.ttft_s == pytest.approx(0.01 + 0.1 + 0.005)  # prefill + transfer, no queue
    # three decode steps at batch 1, contexts 1001, 1002, 1003 -> median is the second
    assert r.itl_s == pytest.approx(0.02 + 1e-3 + 1e-6 * 1002)
    assert r.decode_wait_s == 0.0


def test_two_requests_share_decode_steps_and_the_prefill_queue():
    t = trace([0.0, 0.0], [1000, 1000], [3, 3])
    # one prefill pod: both prompts fit one step's budget and finish together (0.21 s)
    assert simulate_prefill(t, 1, PROFILE, SETTINGS).ttft_s == pytest.approx(0.215)
    # a budget of one prompt: the second waits for the first (TTFTs 0.115 and 0.225 s)
    one_at_a_time = SimSettings(1000, 128, 0.005, 50)
    assert simulate_prefill(t, 1, PROFILE, one_at_a_time).ttft_s == pytest.approx(0.17)
    assert simulate_prefill(t, 2, PROFILE, SETTINGS).ttft_s == pytest.approx(0.115)
    # both ready at once on one decode pod: the second joins when the first's step ends
    one_pod = simulate(t, 2, 1, PROFILE, SETTINGS)
    first_step = 0.02 + 1e-3 + 1e-6 * 1001
    assert one_pod.decode_wait_s == pytest.approx(first_step / 2)  # median of (0, step)
    two_pods = simulate(t, 2, 2, PROFILE, SETTINGS)
    assert two_pods.decode_wait_s == 0.0
    assert two_pods.itl_s == pytest.approx(0.02 + 1e-3 + 1e-6 * 1001, rel=1e-3)


def test_full_batch_makes_requests_wait_for_a_slot():
    t = trace([0.0, 0.0], [100, 100], [11, 11])
    free = simulate(t, 2, 1, PROFILE, SETTINGS)
    full = simulate(t, 2, 1, PROFILE, SimSettings(2048, 1, 0.005, 90))
    one_decode = 10 * (0.02 + 1e-3) + 1e-6 * sum(range(101, 111))
    # the second waits for the whole of the first's decode; p90 of the waits (0, that)
    assert full.decode_wait_s == pytest.approx(0.9 * one_decode, rel=1e-6)
    assert free.decode_wait_s == pytest.approx(0.5 * (0.02 + 1e-3 + 1e-6 * 101))  # p50


def test_more_prefill_replicas_lower_ttft():
    t = draw_trace(make_workload(rate=20), PROFILE.limits.max_model_len)
    ttfts = [simulate_prefill(t, p, PROFILE, SETTINGS).ttft_s for p in range(1, 6)]
    assert all(a >= b for a, b in zip(ttfts, ttfts[1:]))
    assert ttfts[0] > 10 * ttfts[-1]


def test_more_decode_replicas_lower_itl():
    t = draw_trace(make_workload(rate=5), PROFILE.limits.max_model_len)
    itls = [simulate(t, 2, d, PROFILE, SETTINGS).itl_s for d in range(1, 6)]
    assert all(a >= b for a, b in zip(itls, itls[1:]))
    assert itls[0] > 1.5 * itls[-1]


def test_trace_is_seeded_and_follows_the_distributions():
    w = make_workload(rate=5, prompt=300, output=50, num_requests=20000)
    a, b = draw_trace(w, 8192), draw_trace(w, 8192)
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.prompt, b.prompt)
    assert len(a.arrivals) / a.arrivals[-1] == pytest.approx(5, rel=0.03)
    assert a.prompt.mean() == pytest.approx(300, rel=0.03)
    assert a.output.mean() == pytest.approx(50, rel=0.03)
    other = draw_trace(make_workload(rate=5, seed=1), 8192)
    assert not np.array_equal(a.arrivals[:10], other.arrivals[:10])


def test_lengths_fit_the_context_window():
    t = draw_trace(make_workload(rate=1, prompt=3000, output=900, sigma=1.5), 2048)
    assert t.prompt.max() <= 2047 and (t.prompt + t.output).max() <= 2048
    assert t.output.min() >= 1


def test_weighted_percentile_counts_weights():
    values, weights = np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 8.0])
    assert weighted_percentile(values, weights, 50) == 3.0
    assert weighted_percentile(values, weights, 10) == 1.0
    assert weighted_percentile(values, weights, 15) == 2.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=0), r"Workload\.rate=0 must be > 0"),
    (dict(num_requests=3), r"num_requests=3 must be >= 10"),
])
def test_workload_validation_names_the_field(kwargs, message):
    base = dict(rate=1.0, prompt=LengthDist(10), output=LengthDist(10))
    with pytest.raises(ValueError, match=message):
        Workload(**(base | kwargs))


def test_length_validation_names_the_distribution():
    with pytest.raises(ValueError, match=r"prompt\.mean=0\.5 must be >= 1"):
        LengthDist(0.5, name="prompt")
    with pytest.raises(ValueError, match=r"output\.sigma=-1 must be in \[0, 4\]"):
        LengthDist(10, -1, name="output")


def test_prefill_steps_fill_the_budget_chunking_the_last_prompt():
    cost = make_profile(a=0.01, b=1e-4).prefill
    quad = type(cost)(0.01, 1e-4, 1e-8)
    # 300 + 500 tokens arrive together under a budget of 600: step 1 holds the first and
    # 300 tokens of the second, step 2 its last 200 (at offset 300 in its prompt)
    done = batched_prefill(np.array([0.0, 0.0]), np.array([300, 500]), quad, 600)
    step1 = 0.01 + 600e-4 + 1e-8 * (300 * 301 / 2 + 300 * 301 / 2)
    step2 = 0.01 + 200e-4 + 1e-8 * (200 * 300 + 200 * 201 / 2)
    assert done.tolist() == pytest.approx([step1, step1 + step2])
    # a prompt arriving during a step waits for the next one; an idle pod starts at once
    late = batched_prefill(np.array([0.0, 0.001, 5.0]), np.array([100, 100, 100]), cost, 600)
    one = 0.01 + 100e-4
    assert late.tolist() == pytest.approx([one, 2 * one, 5.0 + one])


def test_a_pod_with_half_its_core_takes_twice_as_long_per_step():
    t = trace([0.0], [1000], [4])
    half = SimSettings(2048, 128, 0.005, 50, prefill_cpu_share=0.5, decode_cpu_share=0.5)
    r = simulate(t, 1, 1, PROFILE, half)
    assert r.ttft_s == pytest.approx(2 * (0.01 + 0.1) + 0.005)
    assert r.itl_s == pytest.approx(2 * (0.02 + 1e-3 + 1e-6 * 1002))
    with pytest.raises(ValueError, match="decode_cpu_share=0 must be in"):
        SimSettings(2048, 128, decode_cpu_share=0)


def test_decode_steps_cost_what_the_knots_say_at_each_batch():
    # with knots the straight line c + d * batch (21 / 22 ms here) is not used: batch-1
    # steps cost 40 ms, batch-2 steps 50 ms; half a core doubles them
    from dataclasses import replace

    from baton.planner.profile import DecodeCost

    cost = DecodeCost(0.02, 1e-3, 1e-6, knots=((1, 0.04), (2, 0.05), (16, 0.12)))
    profile = replace(PROFILE, decode=cost)
    alone = simulate(trace([0.0], [1000], [4]), 1, 1, profile, SETTINGS)
    assert alone.itl_s == pytest.approx(0.04 + 1e-6 * 1002)
    # the second joins after the first's first step: 4 of the 6 ITL samples are batch-2
    # steps (contexts 2003 and 2005), so the median is one
    pair = simulate(trace([0.0, 0.0], [1000, 1000], [4, 4]), 2, 1, profile, SETTINGS)
    assert pair.itl_s == pytest.approx(0.05 + 1e-6 * 2003)
    half = SimSettings(2048, 128, 0.005, 50, decode_cpu_share=0.5)
    assert simulate(trace([0.0], [1000], [4]), 1, 1, profile, half).itl_s == pytest.approx(
        2 * (0.04 + 1e-6 * 1002))
