"""The planner loop against a fake Kubernetes: up at once, down only after the hysteresis,
within bounds, nothing in dry-run, and API or metrics failures survived."""

from __future__ import annotations

import math
import threading

import pytest

from baton.planner.base import MetricsError
from baton.planner.plan import SLO, PlanSettings
from baton.planner.scaler import Scaler, ScalerConfig, profile_plan_fn
from tests.unit.planner.factories import FakeKube, FakeMetrics, make_profile, make_workload, rate


def per_rate(est) -> tuple[int, int]:
    """A stand-in plan: one prefill pod per 10 req/s, one decode pod per 5 req/s."""
    return max(1, math.ceil(est.rate / 10)), max(1, math.ceil(est.rate / 5))


def make_scaler(*estimates, prefill=1, decode=1, plan_fn=per_rate, **config):
    kube = FakeKube({"p": prefill, "d": decode})
    cfg = ScalerConfig(**({"namespace": "ns", "prefill_deployment": "p",
                           "decode_deployment": "d", "interval_s": 0.01,
                           "scale_down_after": 3} | config))
    return Scaler(cfg, kube, FakeMetrics(None, *estimates), plan_fn), kube


def ticks(scaler, n):
    return [scaler.tick() for _ in range(n)]


def test_first_scrape_only_records_a_baseline():
    scaler, kube = make_scaler(rate(30))
    report = scaler.tick()
    assert report.estimate is None and report.pools == () and kube.scale_calls == []


def test_scales_up_at_once():
    scaler, kube = make_scaler(rate(30))
    ticks(scaler, 2)
    assert kube.replicas == {"p": 3, "d": 6}
    assert kube.scale_calls == [("p", 3), ("d", 6)]


def test_scales_down_only_after_the_hysteresis_to_the_largest_recent_ask():
    scaler, kube = make_scaler(rate(40), rate(10), rate(20), rate(10), rate(10))
    ticks(scaler, 2)
    assert kube.replicas == {"p": 4, "d": 8}
    reports = ticks(scaler, 2)  # two ticks asking for fewer: nothing yet
    assert kube.replicas == {"p": 4, "d": 8}
    assert [d.action for d in reports[-1].pools] == ["wait", "wait"]
    report = scaler.tick()  # the third in a row: down to the largest of (10, 20, 10) req/s
    assert [d.action for d in report.pools] == ["down", "down"]
    assert kube.replicas == {"p": 2, "d": 4}


def test_a_higher_ask_resets_the_hysteresis():
    scaler, kube = make_scaler(rate(40), rate(10), rate(10), rate(40), rate(10), rate(10))
    ticks(scaler, 7)
    assert kube.replicas == {"p": 4, "d": 8}  # never three lower asks in a row


def test_clamps_to_the_bounds():
    scaler, kube = make_scaler(rate(500), rate(0.1), rate(0.1), rate(0.1),
                               max_prefill=5, max_decode=6, min_decode=2)
    ticks(scaler, 2)
    assert kube.replicas == {"p": 5, "d": 6}
    ticks(scaler, 3)
    assert kube.replicas == {"p": 1, "d": 2}


def test_a_deployment_out_of_bounds_is_brought_in_at_once():
    scaler, kube = make_scaler(rate(1), prefill=12, decode=0, max_prefill=4, min_decode=1)
    ticks(scaler, 2)
    assert kube.replicas == {"p": 4, "d": 1}


def test_dry_run_changes_nothing():
    scaler, kube = make_scaler(rate(30), rate(30), dry_run=True)
    reports = ticks(scaler, 3)
    assert kube.replicas == {"p": 1, "d": 1} and kube.scale_calls == []
    assert [(d.target, d.applied) for d in reports[-1].pools] == [(3, False), (6, False)]


def test_api_errors_are_survived_and_retried():
    scaler, kube = make_scaler(rate(30), rate(30), rate(30))
    scaler.tick()
    kube.failures["read"] = 2  # both pools' reads fail in the next tick
    report = scaler.tick()
    assert "HTTP 503" in report.error and kube.replicas == {"p": 1, "d": 1}
    report = scaler.tick()
    assert report.error is None and kube.replicas == {"p": 3, "d": 6}


def test_a_failed_scale_down_keeps_its_hysteresis_window():
    scaler, kube = make_scaler(rate(10), rate(10), rate(10), rate(10), prefill=3, decode=3)
    ticks(scaler, 3)  # baseline + two lower asks
    kube.failures["scale"] = 1  # the prefill pool's scale-down fails on the third ask
    report = scaler.tick()
    assert "scale p: HTTP 503" in report.error and kube.replicas == {"p": 3, "d": 2}
    scaler.tick()  # the prefill pool's window was not lost: down at the next tick
    assert kube.replicas == {"p": 1, "d": 2}


def test_metrics_errors_are_survived():
    scaler, kube = make_scaler(MetricsError("GET x: connection refused"), rate(30))
    ticks(scaler, 2)
    assert kube.replicas == {"p": 1, "d": 1}
    scaler.tick()
    assert kube.replicas == {"p": 3, "d": 6}


def test_a_missing_deployment_does_not_stop_the_other_pool():
    scaler, kube = make_scaler(rate(30))
    del kube.replicas["p"]
    scaler.tick()
    report = scaler.tick()
    assert "404" in report.error and kube.replicas == {"d": 6}


def test_run_ticks_until_stopped():
    scaler, kube = make_scaler(*[rate(30)] * 50)
    scaler.run(max_ticks=3)
    assert kube.replicas == {"p": 3, "d": 6}
    stop = threading.Event()
    stop.set()
    scaler.run(stop)  # one tick, then the set event ends the loop
    assert len(scaler.metrics.items) == 50 - 3


def test_profile_plan_fn_plans_from_the_measured_workload():
    config = ScalerConfig("ns", "p", "d", max_prefill=6, max_decode=6, min_prefill=1)
    plan_fn = profile_plan_fn(make_profile(), make_workload(rate=1), PlanSettings(
        SLO(1.0, 0.05)), config)
    assert plan_fn(rate(0)) == (1, 1)
    light, heavy = plan_fn(rate(1)), plan_fn(rate(30))
    assert light == (1, 1) and heavy[0] > 1 and heavy[1] > 1
    # longer measured prompts need more prefill at the same rate
    assert plan_fn(rate(30, prompt=1500))[0] > heavy[0]
    assert plan_fn(rate(1000)) == (6, 6)  # beyond the bounds: the maximum of both


@pytest.mark.parametrize("kwargs, message", [
    (dict(namespace=""), r"ScalerConfig\.namespace must not be empty"),
    (dict(interval_s=0), r"ScalerConfig\.interval_s=0 must be > 0"),
    (dict(min_prefill=3, max_prefill=2), r"min_prefill=3 / max_prefill=2 need"),
    (dict(max_decode=0, min_decode=0), r"min_decode=0 / max_decode=0 need"),
    (dict(scale_down_after=0), r"scale_down_after=0 must be >= 1"),
])
def test_config_validation_names_the_field(kwargs, message):
    base = dict(namespace="ns", prefill_deployment="p", decode_deployment="d")
    with pytest.raises(ValueError, match=message):
        ScalerConfig(**(base | kwargs))
