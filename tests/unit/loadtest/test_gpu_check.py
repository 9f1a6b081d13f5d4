"""`make gpu-check` on a machine without CUDA: it says so, runs what it can (the probe, the
GPU tests, which skip), writes its report with `cuda_ran` and `ok` False and exits 0; and its
verdict can only be ok when tensors ran on CUDA and nothing was skipped."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from baton_loadtest.gpu_check import junit_counts, overall_ok
from tests.unit.deploy.kube import ROOT

SCENARIOS = ("colocated", "disagg_up", "kv_nixl", "kv_nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: gpu-check really runs")
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_without_cuda_reports_not_ok_and_exits_0(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check",
                           f"GPU_CHECK_JSON={report_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["cuda_ran"] is False and report["ok"] is False
    assert report["message"].startswith("no CUDA device")
    env = report["environment"]
    assert env["torch"] == str(torch.__version__) and env["device_count"] == 0
    # It ran the GPU tests: collected, every one skipped with the reason, none passed.
    tests = report["gpu_tests"]
    assert tests["passed"] == 0 and tests["failed"] == 0 and tests["errors"] == 0
    assert tests["skipped"] >= 10
    assert all(r.startswith("no CUDA device") for r in tests["skip_reasons"])
    # What needs the device is skipped with the reason.
    for name in SCENARIOS:
        assert report["scenarios"][name]["status"] == "skipped"
        assert report["scenarios"][name]["reason"].startswith("no CUDA device")
    assert report["bench"]["status"] == "skipped"


def passed_report(**changes) -> dict:
    report = {"cuda_ran": True, "gpu_tests": {"status": "ok"}, "bench": {"status": "ok"},
              "scenarios": {name: {"status": "ok"} for name in SCENARIOS}}
    return {**report, **changes}


def test_ok_needs_cuda_and_every_part_passed():
    assert overall_ok(passed_report())
    assert not overall_ok(passed_report(cuda_ran=False))
    assert not overall_ok(passed_report(bench={"status": "skipped", "reason": "x"}))
    scenarios = {name: {"status": "ok"} for name in SCENARIOS}
    scenarios["kv_nccl"] = {"status": "skipped", "reason": "one device"}
    assert not overall_ok(passed_report(scenarios=scenarios))


def test_junit_counts_read_every_outcome(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="boom"/></testcase>'
        '<testcase classname="a" name="broken"><error message="setup"/></testcase>'
        '<testcase classname="a" name="s1"><skipped message="no CUDA device: x"/></testcase>'
        '<testcase classname="a" name="s2"><skipped message="no CUDA device: x"/></testcase>'
        '</testsuite></testsuites>')
    assert junit_counts(path) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 2,
                                  "skip_reasons": {"no CUDA device: x": 2}}
