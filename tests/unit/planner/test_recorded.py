"""The simulation against measured runs: each fixture under fixtures/ is a run recorded on a
local cluster by `python -m benchmarks.planner_check --record` (the profile, the requests as
sent, the replica counts and the client's p90s); replaying its requests through the simulation
must land within 15% of what was measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from baton.planner.recorded import Measured, RecordedRun
from baton.planner.simulate import SimSettings, Trace
from tests.unit.planner.factories import make_profile

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("*.json"))
TOLERANCE = 0.15


def test_there_is_a_recorded_run_to_check():
    assert FIXTURES, "record one: see benchmarks.planner_check"


# Known misses, each checked strictly so that a model that starts to reproduce it is
# noticed. chat_1p1d_a was recorded with 41% of the decode core (the two-core development
# machine shared with other sessions): the simulation slows each step by the measured share,
# which reproduces the typical step (median ITL measured / predicted 180 / 177 ms) but not
# the tail the kernel's scheduler adds on a contended core (p90 -41%). chat_1p1d_b (78% of
# the core) missed by -24% too until the decode cost became piecewise linear in the batch;
# it now lands at -14%.
KNOWN_MISSES = {
    ("chat_1p1d_a", "itl"): "recorded with 41% of the decode core: the ITL tail of a "
                            "contended core is not modelled",
}


def _cases():
    for path in FIXTURES:
        for metric in ("ttft", "itl"):
            reason = KNOWN_MISSES.get((path.stem, metric))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(path, metric, marks=marks, id=f"{path.stem}-{metric}")


@pytest.mark.parametrize("path, metric", list(_cases()))
def test_prediction_is_within_15_percent_of_the_measured_run(path, metric):
    run = RecordedRun.load(path)
    err = run.errors()[metric]
    predicted = getattr(run.predict(), f"{metric}_s")
    measured = getattr(run.measured, f"{metric}_s")
    assert abs(err) <= TOLERANCE, (f"{run.name}: predicted p90 {metric.upper()} "
                                   f"{predicted:.3f} s vs measured {measured:.3f} s ({err:+.0%})")


def _run(ttft: float = 1.0) -> RecordedRun:
    trace = Trace(np.array([0.0, 1.0, 2.5]), np.array([100, 300, 50]), np.array([5, 9, 1]))
    return RecordedRun("synthetic 1P:1D", make_profile(), SimSettings(2048, 8), 1, 1, trace,
                       Measured(ttft, 0.02))


def test_recorded_run_round_trips_and_predicts_its_own_trace(tmp_path):
    run = _run()
    run.save(tmp_path / "r.json")
    loaded = RecordedRun.load(tmp_path / "r.json")
    assert loaded.to_dict() == run.to_dict()
    assert loaded.predict() == run.predict()
    errors = loaded.errors()
    assert errors["ttft"] == pytest.approx(run.predict().ttft_s / 1.0 - 1)


def test_a_bad_record_names_what_is_wrong():
    raw = _run().to_dict()
    with pytest.raises(ValueError, match="version=7 is not supported"):
        RecordedRun.from_dict(raw | {"version": 7})
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        RecordedRun.from_dict(raw | {"measured": {"ttft_s": 0.0, "itl_s": 0.02}})
    raw["trace"]["prompt"] = raw["trace"]["prompt"][:2]
    with pytest.raises(ValueError, match="one length"):
        RecordedRun.from_dict(raw)
