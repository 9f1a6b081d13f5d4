"""The replica search: the fewest replicas meeting both targets, more under more load, the
same answer for the same seed, and a clear error when the targets cannot be met."""

from __future__ import annotations

import time

import pytest

from baton.planner.plan import SLO, PlanError, PlanSettings, format_plan, plan
from baton.planner.simulate import SimSettings, draw_trace, simulate
from tests.unit.planner.factories import make_profile, make_workload

PROFILE = make_profile()
SLO_1S = SLO(ttft_s=1.0, itl_s=0.05)


def settings(slo: SLO = SLO_1S, **kw) -> PlanSettings:
    return PlanSettings(slo, **({"max_replicas": 32} | kw))


def test_trivial_load_needs_one_of_each():
    result = plan(PROFILE, make_workload(rate=0.2), settings())
    assert (result.prefill, result.decode) == (1, 1)
    assert result.rows[-1].meets and result.rows[-1].decode == 1


def test_heavy_load_needs_more_and_the_answer_meets_both_targets():
    result = plan(PROFILE, make_workload(rate=40), settings())
    assert result.prefill > 2 and result.decode > 2
    answer = [r for r in result.rows if (r.prefill, r.decode) == (result.prefill,
                                                                   result.decode)]
    assert answer[0].meets
    assert answer[0].ttft_s <= 1.0 and answer[0].itl_s <= 0.05


def test_the_answer_is_minimal():
    result = plan(PROFILE, make_workload(rate=40), settings())
    trace = draw_trace(make_workload(rate=40), PROFILE.limits.max_model_len)
    sim = SimSettings.for_profile(PROFILE)
    for p, d in [(result.prefill - 1, result.decode), (result.prefill, result.decode - 1)]:
        r = simulate(trace, p, d, PROFILE, sim)
        assert r.ttft_s > 1.0 or r.itl_s > 0.05  # one replica fewer in either pool fails


def test_replicas_grow_with_the_rate():
    totals = [plan(PROFILE, make_workload(rate=r), settings()).total
              for r in (1, 5, 10, 20, 40, 60)]
    assert totals == sorted(totals)
    assert totals[0] == 2 and totals[-1] > totals[2]


def test_tighter_slo_needs_more_replicas():
    loose = plan(PROFILE, make_workload(rate=20), settings(SLO(2.0, 0.08)))
    tight = plan(PROFILE, make_workload(rate=20), settings(SLO(0.3, 0.02)))
    assert tight.prefill >= loose.prefill and tight.decode >= loose.decode
    assert tight.total > loose.total


def test_plan_is_deterministic_for_a_seed():
    a = plan(PROFILE, make_workload(rate=20, seed=7), settings())
    b = plan(PROFILE, make_workload(rate=20, seed=7), settings())
    assert a == b
    c = plan(PROFILE, make_workload(rate=20, seed=8), settings())
    assert [r.ttft_s for r in c.rows] != [r.ttft_s for r in a.rows]


def test_impossible_itl_names_the_itl_target():
    with pytest.raises(PlanError, match=r"ITL p90 <= 0\.005 s cannot be met: a decode step "
                                        r"takes at least 0\.0105 s"):
        plan(PROFILE, make_workload(rate=1), settings(SLO(1.0, 0.005)))


def test_impossible_ttft_names_the_ttft_target():
    with pytest.raises(PlanError, match=r"TTFT p90 <= 0\.05 s cannot be met: prefilling "
                                        r"the prompts alone takes"):
        plan(PROFILE, make_workload(rate=1), settings(SLO(0.05, 0.05)))


def test_too_few_replicas_reports_the_best_reached():
    with pytest.raises(PlanError) as err:
        plan(PROFILE, make_workload(rate=60), settings(max_replicas=4))
    message = str(err.value)
    assert "TTFT p90 <= 1 s fails with up to 3 prefill replicas: the best is" in message
    assert "with 3 (raise --max-replicas)" in message
    assert [r.prefill for r in err.value.rows] == [1, 2, 3]


def test_decode_bound_reports_itl():
    with pytest.raises(PlanError, match=r"ITL p90 <= 0\.05 s fails with up to 2 decode "
                                        r"replicas: the best is"):
        plan(PROFILE, make_workload(rate=40), settings(max_decode=2))


def test_output_names_the_answer_and_json_carries_the_rows():
    result = plan(PROFILE, make_workload(rate=10), settings())
    text = format_plan(result, PROFILE)
    assert f"answer: {result.prefill} prefill + {result.decode} decode" in text
    assert "ttft_p90_s" in text and "itl_p90_s" in text
    doc = result.to_json()
    assert doc["total"] == result.total and len(doc["rows"]) == len(result.rows)
    assert doc["workload"]["rate"] == 10


def test_a_plan_over_ten_candidates_takes_seconds():
    t0 = time.perf_counter()
    result = plan(PROFILE, make_workload(rate=60), settings())
    assert len(result.rows) >= 10
    assert time.perf_counter() - t0 < 10.0  # ~0.2 s on an idle core; generous when shared


@pytest.mark.parametrize("kwargs, message", [
    (dict(ttft_s=0), r"SLO\.ttft_s=0 must be > 0"),
    (dict(itl_s=-1), r"SLO\.itl_s=-1 must be > 0"),
    (dict(percentile=100), r"SLO\.percentile=100 must be in \(0, 100\)"),
])
def test_slo_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SLO(**({"ttft_s": 1.0, "itl_s": 0.1} | kwargs))


def test_settings_validation_names_the_field():
    with pytest.raises(ValueError, match=r"max_replicas=1 must be >= 2"):
        PlanSettings(SLO_1S, max_replicas=1)
    with pytest.raises(ValueError, match=r"max_decode=0 must be >= 1"):
        PlanSettings(SLO_1S, max_decode=0)
