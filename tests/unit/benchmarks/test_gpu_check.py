"""`make gpu-check` on a machine without CUDA: it says so, runs what it can (preflight, the
model, the GPU tests' collection, which all skip), writes its report with `cuda_ran` and `ok`
False and exits 0; a piece that hangs loses only itself, and nothing it started outlives it;
the verdict is ok only when tensors ran on CUDA and every piece the machine can run passed.
(The whole check from the kit, in the GPU machine's package set: tests/integration/
test_gpu_lease.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from argparse import Namespace

import pytest
import torch

from benchmarks.gpu_check import Check, headline_numbers
from benchmarks.gpu_check_pieces import PIECES, PieceRunner
from benchmarks.gpu_pieces import junit_counts, unexpected_skips
from tests.unit.deploy.kube import ROOT

GPU_PIECES = [p.name for p in PIECES if p.gpus]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: gpu-check really runs")
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_without_cuda_reports_every_piece_and_exits_0(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check",
                           f"GPU_CHECK_JSON={report_path}",
                           "GPU_CHECK_ARGS=--skip kernel_tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["done"] and report["cuda_ran"] is False and report["ok"] is False
    assert report["message"].startswith("no CUDA device")
    env = report["environment"]
    assert env["torch"] == str(torch.__version__) and env["device_count"] == 0
    pieces = report["pieces"]
    assert set(pieces) == {p.name for p in PIECES} - {"kernel_tests"}
    assert pieces["preflight"]["status"] == "ok", pieces["preflight"]
    assert pieces["model"]["source"] == "bundled"
    assert pieces["engine_cpu"]["status"] == "ok" and pieces["engine_cpu"]["equal"]
    # The GPU tests were collected, every one skipped with the reason, none passed.
    tests = pieces["engine_tests"]
    assert tests["status"] == "ok" and tests["passed"] == 0 and tests["skipped"] >= 4
    assert all(r.startswith("no CUDA device") for r in tests["skip_reasons"])
    for name in GPU_PIECES:  # what needs the device is skipped with the reason
        assert pieces[name]["status"] == "skipped"
        assert pieces[name]["reason"].startswith("no CUDA device")
    assert set(report["multi_gpu"]) == {"kv_nccl", "tp2"}
    assert set(GPU_PIECES) - {"kv_nccl", "tp2"} < set(report["one_gpu"])
    assert report["setup"]["preflight"] == "ok"
    assert (report_path.parent / "report.logs" / "preflight.log").exists()


def check_for(tmp_path, device_count: int, cuda_ran: bool = True, only=()) -> Check:
    args = Namespace(deadline_s=480.0, only=set(only), skip=set(), limits={}, kit=None, run_dir=None)
    check = Check(args, tmp_path / "r.json", tmp_path, tmp_path)
    check.report.update(environment={"device_count": device_count}, cuda_ran=cuda_ran,
                        probe_reason=None if cuda_ran else "no CUDA device: x")
    return check


def passed(check: Check, names) -> None:
    for name in names:
        check.report["pieces"][name] = {"status": "ok"}


def test_ok_needs_cuda_and_every_piece_the_machine_can_run(tmp_path):
    one_gpu = [p.name for p in PIECES if p.gpus <= 1]
    check = check_for(tmp_path, 1)
    passed(check, one_gpu)
    for name in ("kv_nccl", "tp2"):  # two-GPU pieces, skipped on one: listed apart
        check.report["pieces"][name] = {"status": "skipped", "reason": "needs 2"}
    check.finish()
    assert check.report["ok"] and check.report["multi_gpu"] == {"kv_nccl": "skipped",
                                                                 "tp2": "skipped"}
    check = check_for(tmp_path, 2)  # with two devices they count
    passed(check, one_gpu)
    check.report["pieces"]["kv_nccl"] = {"status": "ok"}
    check.report["pieces"]["tp2"] = {"status": "timeout"}
    check.finish()
    assert not check.report["ok"]
    check = check_for(tmp_path, 1, cuda_ran=False)
    passed(check, one_gpu)
    check.finish()
    assert not check.report["ok"]
    check = check_for(tmp_path, 1, only=("probe",))  # a partial run proves nothing whole
    passed(check, ["probe"])
    check.finish()
    assert not check.report["ok"]


def test_a_piece_that_needs_more_gpus_or_the_model_says_why(tmp_path):
    check = check_for(tmp_path, 1)
    by_name = {p.name: p for p in PIECES}
    assert "needs 2 CUDA devices, this machine has 1" in check.cannot_run(by_name["kv_nccl"], 1)
    assert check.cannot_run(by_name["colocated"], 1).startswith("no model")
    assert check.cannot_run(by_name["kernel_tests"], 1) is None
    check.runner.model_dir = tmp_path
    assert check.cannot_run(by_name["colocated"], 1) is None
    cpu = check_for(tmp_path, 0, cuda_ran=False)
    assert cpu.cannot_run(by_name["bench_kernels"], 0) == "no CUDA device: x"


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
    counts = junit_counts(path)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 2}
    assert counts["skip_reasons"] == {"no CUDA device: x": 2}
    assert counts["tests"] == {"ok": "passed", "bad": "failed", "broken": "errors",
                               "s1": "skipped", "s2": "skipped"}


def test_on_a_gpu_only_a_test_for_more_gpus_than_it_has_may_skip():
    """engine_tests on a 1-GPU machine: the 2-GPU test's skip is expected, any other is not."""
    two = {"tensor parallelism needs 2 GPUs": 1}
    assert unexpected_skips(two, device_count=1) == 0
    assert unexpected_skips(two, device_count=2) == 1  # it had them: the skip is a fault
    assert unexpected_skips({**two, "no CUDA device: x": 3}, device_count=1) == 3
    assert unexpected_skips({}, device_count=1) == 0


def test_headline_numbers_come_from_the_bench_and_scenarios():
    pieces = {
        "bench_kernels": {"results": {"copy": {"gbps": 2900.04},
                                      "kernels": {"best_large": {"fraction_of_copy": 0.8123}}}},
        "bench_engine": {"results": {"engine": {
            "weight_floor": {"step_over_floor": 1.234, "step_ms": 6.1},
            "batches": [{"batch": 1, "output_tok_s": 160.04, "async_scheduling": "off"},
                        {"batch": 1, "output_tok_s": 170.04, "async_scheduling": "on",
                         "device_busy": 0.9876},
                        {"batch": 8, "async_scheduling": "on", "error": "RuntimeError: x"}],
            "sim": {"fit": {"memory_bandwidth_gbs": 2700.0, "launch_us": 250.0}}}}},
        "bench_quant": {"results": {"formats": {"fp8_channel": {"1": {"vs_bf16": 0.55}},
                                                "w4a16_g128": {"16": {"vs_bf16": 0.4}}}}},
        "kv_nixl": {"kv_pull": {"gbps": 41.5}},
    }
    assert headline_numbers(pieces) == {
        "decode_attention_share_of_copy": 0.812, "copy_gbps": 2900.0,
        "batch1_step_over_weight_floor": 1.23, "batch1_step_ms": 6.1,
        "decode_tok_s_batch1": 160.0, "decode_tok_s_batch1_ahead": 170.0,
        "device_busy_batch1_ahead": 0.988, "decode_batch8_ahead_error": "RuntimeError: x",
        "sim_profile_fit": {"memory_bandwidth_gbs": 2700.0, "launch_us": 250.0},
        "fp8_channel_batch1_step_vs_bf16": 0.55,
        "kv_nixl_pull_gbps": 41.5}


# A piece that starts a server through a middle process that exits (so the server is
# re-parented to the check, a subreaper) and then hangs: the limit stops the piece, the sweep
# stops the server it left behind.
HANGING_PIECE = textwrap.dedent("""
    import subprocess, sys, time
    spawn = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(300)'], start_new_session=True, "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    middle = subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True)
    print(middle.stdout.strip(), flush=True)
    time.sleep(300)
""")
CHECKER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from benchmarks.gpu_pieces import (alive, become_subreaper, run_subprocess,
                                       sweep_orphans)
    assert become_subreaper()
    log = Path(sys.argv[1])
    started = time.monotonic()
    result = run_subprocess([sys.executable, "-c", sys.argv[2]], log, 2.0, dict(os.environ),
                            Path.cwd())
    server = int(log.read_text().split()[0])
    swept = sweep_orphans(set())
    print(json.dumps({"result": result["status"], "seconds": time.monotonic() - started,
                      "server": server, "swept": swept, "server_alive": alive(server)}))
""")


def test_a_piece_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(ROOT / p) for p in ("services", "kernels", "loadtest", "."))}
    proc = subprocess.run([sys.executable, "-c", CHECKER, str(tmp_path / "piece.log"),
                           HANGING_PIECE], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["result"] == "timeout" and out["seconds"] < 30
    assert out["server"] in out["swept"] and not out["server_alive"]


class SleepingRunner(PieceRunner):
    """Every piece takes `seconds[name]` (sleeping) and passes: the deadline's arithmetic."""

    def __init__(self, args, tmp_path, seconds: dict[str, float]):
        super().__init__(args, tmp_path, tmp_path)
        self.model_dir, self.seconds, self.given = tmp_path, seconds, {}

    def run(self, piece, timeout):
        self.given[piece.name] = timeout
        time.sleep(min(self.seconds.get(piece.name, 0.0), timeout))
        return {"status": "ok" if self.seconds.get(piece.name, 0.0) <= timeout else "timeout"}


class TimedCheck(Check):
    min_piece_s = 0.3

    def __init__(self, tmp_path, deadline_s: float, seconds: dict[str, float], limits=None,
                 runner=SleepingRunner):
        args = Namespace(deadline_s=deadline_s, only=set(), skip=set(), limits=limits or {},
                         kit=None, run_dir=None)
        super().__init__(args, tmp_path / "r.json", tmp_path, tmp_path,
                         runner(args, tmp_path, seconds))
        self.report.update(environment={"device_count": 1}, cuda_ran=True, probe_reason=None)
        self.given = self.runner.given


def test_the_deadline_cuts_each_piece_and_skips_what_it_cannot_start(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.gpu_check.RESERVE_S", 0.2)
    # a deadline with room for a slow machine's kill of the first piece
    check = TimedCheck(tmp_path, 5.0, {"kernel_tests": 30.0, "engine_tests": 30.0},
                       limits={"kernel_tests": 1.2})
    report = check.run()
    pieces = report["pieces"]
    assert pieces["kernel_tests"]["status"] == "timeout"  # its own limit
    assert check.given["kernel_tests"] == 1.2
    # The next gets what is left of the deadline (less the reserve); then nothing starts.
    assert 0.3 < check.given["engine_tests"] < 5.0 - 1.2 - 0.2 + 0.05
    assert pieces["engine_tests"]["status"] == "timeout"
    late = [n for n, r in pieces.items() if r.get("reason", "").startswith("deadline")]
    assert late == ["bench_kernels", "bench_quant", "bench_engine", "bench_kv_tier", "engine_cpu"]
    assert pieces["kv_nccl"]["reason"].startswith("needs 2 CUDA devices")
    assert json.loads((tmp_path / "r.json").read_text())["pieces"] == pieces  # written as it went


def test_only_brings_what_its_pieces_need(tmp_path):
    from benchmarks.gpu_check_pieces import with_dependencies

    assert with_dependencies({"kv_nixl"}, tmp_path) == {"kv_nixl", "probe", "model",
                                                        "colocated"}
    (tmp_path / "colocated.json").write_text("{}")  # an earlier call's reference
    assert with_dependencies({"kv_nixl"}, tmp_path) == {"kv_nixl", "probe", "model"}
    assert with_dependencies({"bench_kernels"}, tmp_path) == {"bench_kernels", "probe"}


def test_a_piece_that_raises_loses_only_itself(tmp_path):
    class Broken(SleepingRunner):
        def run(self, piece, timeout):
            if piece.name == "kernel_tests":
                raise KeyError("a bug in the check")
            return super().run(piece, timeout)

    report = TimedCheck(tmp_path, 30.0, {}, runner=Broken).run()
    assert report["pieces"]["kernel_tests"]["status"] == "error"
    assert "a bug in the check" in report["pieces"]["kernel_tests"]["error"]
    assert report["pieces"]["engine_tests"]["status"] == "ok"
