"""planner-check's pieces without servers: the measured trace, the CPU share from the
kernel's run-queue accounting, the comparison and its report."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from baton.planner.recorded import Measured, RecordedRun
from baton.planner.simulate import SimSettings, Trace
from baton_loadtest.client import RequestRecord
from benchmarks.planner_check import (
    comparison,
    cpu_share,
    main,
    markdown,
    measured_trace,
    runqueue_times,
)
from tests.unit.planner.factories import make_profile


def test_measured_trace_keeps_the_requests_that_succeeded_in_send_order():
    recs = [RequestRecord(0, 2.0, ok=True, prompt_tokens=100, output_tokens=10),
            RequestRecord(1, 1.0, ok=True, prompt_tokens=50, output_tokens=1),
            RequestRecord(2, 0.5, ok=False, error="HTTP 500")]
    t = measured_trace(recs)
    assert t.arrivals.tolist() == [1.0, 2.0]
    assert t.prompt.tolist() == [50, 100] and t.output.tolist() == [1, 10]
    with pytest.raises(RuntimeError, match="no request succeeded"):
        measured_trace(recs[2:])


def test_cpu_share_is_run_time_over_runnable_time_across_threads():
    before = [{1: (100, 50), 2: (10, 0)}]
    # thread 1 ran 300 ns more and waited 100 more; thread 3 is new (counted from zero)
    after = [{1: (400, 150), 3: (100, 100)}]
    assert cpu_share(before, after) == pytest.approx(400 / 600)
    assert cpu_share([{}], [{}]) == 1.0  # nothing ran: nothing slowed it


def test_runqueue_times_reads_this_process_threads():
    times = runqueue_times(os.getpid())
    assert os.getpid() in times
    on_cpu, waiting = times[os.getpid()]
    assert on_cpu > 0 and waiting >= 0


def _run(share: float) -> RecordedRun:
    trace = Trace(np.array([0.0, 1.0]), np.array([100, 300]), np.array([5, 9]))
    settings = SimSettings(2048, 8, prefill_cpu_share=share, decode_cpu_share=share)
    own = RecordedRun("x", make_profile(), SimSettings(2048, 8), 1, 1, trace, Measured(1, 1))
    r = own.predict()
    # measured: what pods with half their cores do
    return RecordedRun("chat 1P:1D", make_profile(), settings, 1, 1, trace,
                       Measured(r.ttft_s * 2, r.itl_s * 2))


def test_comparison_reports_both_predictions_and_the_error_of_the_shared_one():
    run = _run(0.5)
    planned = SimpleNamespace(ttft_s=0.2, itl_s=0.03)
    rows = comparison(run, planned)
    ttft = rows["ttft_p90_s"]
    assert ttft["predicted"] == pytest.approx(run.predict().ttft_s)
    assert ttft["own_cores"] < ttft["predicted"]
    # the measured values are the own-cores ones doubled; halving the share recovers TTFT
    # up to the 5 ms transfer, which does not scale, and ITL exactly
    assert rows["itl_p90_s"]["rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert rows["itl_p90_s"]["rel_error_own_cores"] == pytest.approx(-0.5)
    assert abs(ttft["rel_error"]) < 0.05 and ttft["within_tolerance"]
    result = {"workload": "chat", "rate": 0.2, "dtype": "float32", "cores": 2,
              "slo": {"ttft_s": 1.0, "itl_s": 0.1}, "plan": {"prefill": 1, "decode": 1},
              "note": "n", "variants": {"recommended": {
                  "label": "1P:1D", "comparison": rows, "cpu_share": {"prefill": 0.5},
                  "measured": {}, "meets_slo": False, "errors": 0}}}
    text = markdown(result)
    assert "| 1P:1D | itl_p90_s | 30.0 |" in text and "+0.0% | yes |" in text
    assert "CPU share while runnable: prefill 50%" in text


def test_planner_check_has_its_own_command_line(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--record" in capsys.readouterr().out
