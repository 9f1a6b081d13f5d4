"""The simulated device's profile fitted to measured step times (`benchmarks/sim_calibration`):
steps timed on a device the profile describes give the profile's own numbers back."""

from __future__ import annotations

import pytest

from baton.engine.sim.profile import load_profile
from benchmarks.gpu_bench import SHAPES
from benchmarks.sim_calibration import (
    calibrate,
    decode_contexts,
    fit,
    modelled_ms,
    profile_for,
    step_work,
    with_shape,
)


def test_profile_follows_the_gpus_name():
    assert profile_for("NVIDIA H200").name == "h200-llama3-8b"
    assert profile_for("NVIDIA H100 80GB HBM3").name == "h100-llama3-8b"
    assert profile_for("cpu").name == "h100-llama3-8b"


def test_decode_contexts_count_from_the_first_timed_step():
    # decode step 1 attends to the prompt alone; steps 3.. are timed
    assert decode_contexts(128, 3, 4) == [130, 131, 132, 133]


def _modelled_rows(profile, batches, prompt_len=1024):
    contexts = decode_contexts(prompt_len, 3, 64)
    rows = []
    for batch in batches:
        sim_bytes, sim_flops = step_work(profile, batch, contexts)
        rows.append({"batch": batch, "step_ms_mean": 99.0, "sim_bytes": sim_bytes,
                     "sim_flops": sim_flops, "device_ms": modelled_ms(profile, batch, contexts)})
    return rows


def test_fit_recovers_the_profile_from_steps_it_models():
    """Memory-bound decode steps modelled by the profile itself, fitted: its bandwidth and
    launch cost come back, and no peak (no step was bound by compute)."""
    profile = with_shape(load_profile("h100-llama3-8b"), SHAPES["llama3-8b"], 2, 2)
    result = calibrate(profile, _modelled_rows(profile, (1, 8, 32, 64)))["fit"]
    assert result["memory_bandwidth_gbs"] == pytest.approx(2850, rel=1e-3)
    assert result["launch_us"] == pytest.approx(300, abs=0.5)
    assert result["peak_tflops"] is None and result["compute_bound_points"] == 0
    assert result["max_relative_residual"] < 1e-3 and result["points"] == 4


def test_fit_finds_the_peak_where_large_batches_are_bound_by_compute():
    """Batches past the compute ridge (prompts of 128: little KV, so 8B's ridge is at a few
    hundred rows) give the peak back beside the bandwidth and launch cost."""
    profile = with_shape(load_profile("h100-llama3-8b"), SHAPES["llama3-8b"], 2, 2)
    rows = _modelled_rows(profile, (1, 16, 64, 512, 1024), prompt_len=128)
    result = calibrate(profile, rows)["fit"]
    assert result["compute_bound_points"] == 2
    assert result["memory_bandwidth_gbs"] == pytest.approx(2850, rel=1e-3)
    assert result["peak_tflops"] == pytest.approx(600, rel=1e-3)
    assert result["launch_us"] == pytest.approx(300, abs=0.5)
    assert result["max_relative_residual"] < 1e-3


def test_the_h200_profile_models_the_steps_measured_on_an_h200():
    """The bundled H200 profile is the fit of `make gpu-check`'s 8B steps on an H200
    (2026-11-28: 5.48 / 6.44 / 11.78 ms at batch 1 / 32 / 256 launched ahead, prompt 128):
    it models each within 6%, the largest bound by compute."""
    profile = with_shape(load_profile("h200-llama3-8b"), SHAPES["llama3-8b"], 2, 2)
    contexts = decode_contexts(128, 3, 124)
    for batch, measured in ((1, 5.48), (32, 6.44), (256, 11.78)):
        assert modelled_ms(profile, batch, contexts) == pytest.approx(measured, rel=0.06)
    refit = fit([(*step_work(profile, b, contexts), ms)
                 for b, ms in ((1, 5.48), (32, 6.44), (256, 11.78))])
    assert refit is not None and refit["compute_bound_points"] == 1
    assert refit["memory_bandwidth_gbs"] == pytest.approx(
        profile.device.memory_bandwidth_gbs, rel=0.01)
    assert refit["peak_tflops"] == pytest.approx(profile.device.peak_tflops, rel=0.01)


def test_a_batch_counts_once_by_its_tightest_time():
    """A batch timed synchronously (wall: device + host) and ahead (device) counts by the
    lower; a row without a device time uses its wall."""
    rows = [{"batch": 1, "sim_bytes": 1e9, "sim_flops": 1e9, "step_ms_mean": 2.0,
             "device_ms": None},
            {"batch": 1, "sim_bytes": 1e9, "sim_flops": 1e9, "step_ms_mean": 1.9,
             "device_ms": 1.5},
            {"batch": 2, "sim_bytes": 2e9, "sim_flops": 2e9, "step_ms_mean": 2.5,
             "device_ms": None}]
    result = calibrate(load_profile("h100-llama3-8b"), rows)["fit"]
    # (1 GB, 1.5 ms) and (2 GB, 2.5 ms): 1 ms per GB = 1000 GB/s, 0.5 ms fixed
    assert result["memory_bandwidth_gbs"] == pytest.approx(1000)
    assert result["launch_us"] == pytest.approx(500)
    assert result["points"] == 2


@pytest.mark.parametrize("points", [
    [],
    [(1e9, 1e9, 1.0), (1e9, 1e9, 1.0)],  # one point twice
    [(1e9, 1e9, 2.0), (2e9, 2e9, 1.0)],  # faster with more of everything: no rate
])
def test_no_fit_without_a_physical_one(points):
    assert fit(points) is None


def test_rows_that_failed_are_left_out():
    rows = [{"batch": 1, "async_scheduling": "on", "error": "RuntimeError: x"}]
    assert calibrate(load_profile("h100-llama3-8b"), rows)["fit"] is None
