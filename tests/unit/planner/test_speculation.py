"""Speculative decoding in the planner (`planner.speculation`): learnt from the pods'
counters, simulated as rows per step and tokens per step, and used by the live planner."""

from __future__ import annotations

import numpy as np
import pytest

from baton.common.metrics import WorkerMetrics
from baton.common.stats import EngineStats, SpecStats
from baton.planner.base import WorkloadEstimate
from baton.planner.metrics_source import ScrapeSource
from baton.planner.plan import SLO, PlanSettings
from baton.planner.scaler import ScalerConfig, profile_plan_fn
from baton.planner.simulate import SimSettings, Trace, simulate
from baton.planner.speculation import Speculation
from tests.unit.planner.factories import make_profile, make_workload
from tests.unit.planner.test_metrics_source import Clock, render, server  # noqa: F401

PROFILE = make_profile(a=0.01, b=1e-4, c=0.02, d=1e-3, e=1e-6)


def test_learnt_from_decode_tokens_and_accepted_guesses():
    # 1,000 decode tokens of which 600 accepted guesses: 400 request-steps, 2.5 tokens
    # each; 800 guesses over them: 3 rows each
    spec = Speculation.from_counters(1000, 600, 800)
    assert spec == Speculation(2.5, 3.0)
    assert Speculation.from_counters(0, 0, 0) is None  # no decode step in the window
    assert Speculation.from_counters(100, 0, 0) == Speculation()  # never guessed


@pytest.mark.parametrize("tokens, rows", [(0.5, 1.0), (3.0, 2.0), (2.0, 18.0)])
def test_impossible_values_are_refused(tokens, rows):
    with pytest.raises(ValueError, match="tokens_per_step"):
        Speculation(tokens, rows)


def test_a_speculating_pod_runs_fewer_wider_steps():
    t = Trace(np.array([0.0]), np.array([100]), np.array([11]))  # 10 decode tokens
    plain = SimSettings(2048, 128, 0.005, 50)
    spec = SimSettings(2048, 128, 0.005, 50, speculation=Speculation(2.5, 5.0))
    step = 0.02 + 1e-3 * 5  # g(5 rows): the guesses are rows of the step
    r = simulate(t, 1, 1, PROFILE, spec)
    # 4 steps (2.5 tokens each); contexts 101, 103.5, 106, 108.5; each token's ITL a
    # step over the 2.5 tokens it gave; the median of the 4 steps' ITLs: the second
    assert r.itl_s == pytest.approx((step + 1e-6 * 103.5) / 2.5)
    assert simulate(t, 1, 1, PROFILE, plain).itl_s == pytest.approx(0.021 + 1e-6 * 105)


def worker_page(finished: int, generated: int, proposed: int, accepted: int) -> bytes:
    stats = EngineStats(prompt_tokens_total=1000, generation_tokens_total=generated,
                        spec=SpecStats("ngram", proposed, accepted, accepted // 2))
    m = WorkerMetrics(lambda: stats)
    m.requests.labels("stop").inc(finished)
    return render(m.registry)


def test_the_live_source_reads_what_speculation_did(server):  # noqa: F811
    pages, url = server
    pages.push(worker_page(finished=10, generated=1000, proposed=100, accepted=50))
    # +20 requests, +2,020 tokens (2,000 by decode steps), +1,000 of 1,600 guesses kept
    pages.push(worker_page(finished=30, generated=3020, proposed=1700, accepted=1050))
    clock = Clock()
    source = ScrapeSource(url, clock=clock)
    source.sample()
    clock.now += 10.0
    est = source.sample()
    assert est.speculation == Speculation(2.0, 2.6)  # 1,000 request-steps


def test_the_live_planner_plans_with_the_learnt_speculation():
    """A memory-bound decode step (rows nearly free, as on a GPU at small batch): 3 tokens
    per step for 4 rows serve the same rate with about half the decode pods."""
    bound = make_profile(a=0.01, b=1e-4, c=0.02, d=2e-4, e=1e-7, max_num_seqs=16)
    config = ScalerConfig("ns", "p", "d", max_prefill=8, max_decode=8)
    plan_fn = profile_plan_fn(bound, make_workload(rate=1, output=400), PlanSettings(
        SLO(2.0, 0.04)), config)
    plain = plan_fn(WorkloadEstimate(rate=8.0, window_s=30.0))
    fast = plan_fn(WorkloadEstimate(rate=8.0, window_s=30.0,
                                    speculation=Speculation(3.0, 4.0)))
    assert plain[1] >= 5 and fast[1] <= plain[1] // 2 + 1
