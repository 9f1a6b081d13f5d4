"""The serving benchmark's CPU accounting (fast) and one tiny end-to-end run (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from baton.engine.async_engine import ENGINE_THREAD_NAME, name_os_thread
from benchmarks.threads_cpu import cpu_by_role, descendants
from tests.unit.deploy.kube import ROOT


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_by_role_tells_the_engine_thread_from_the_loop_and_its_children():
    started, stop = threading.Event(), threading.Event()

    def engine() -> None:
        name_os_thread(ENGINE_THREAD_NAME)
        child = threading.Thread(target=_burn, args=(0.3,))  # inherits the engine's name
        child.start()
        _burn(0.6)
        child.join()
        started.set()
        stop.wait(10)

    before = cpu_by_role([os.getpid()], main_role="loop")
    t = threading.Thread(target=engine)
    t.start()
    _burn(0.2)
    started.wait(10)
    after = cpu_by_role([os.getpid()], main_role="loop")
    stop.set()
    t.join()
    gained = {k: after[k] - before.get(k, 0.0) for k in after}
    assert 0.45 <= gained["engine thread"] <= 0.9, gained
    assert 0.15 <= gained["loop"] <= 0.5, gained
    assert gained.get("compute threads", 0.0) < 0.5


def test_descendants_walks_the_process_tree():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        assert descendants(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_serving_bench_runs_offline_and_serve_and_writes_its_report(tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving_bench", "--num-requests", "2",
         "--dtype", "float32", "--paths", "offline,serve", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {"offline", "serve"}
    serve = report["paths"]["serve"]
    assert serve["output_tok_s"] > 0 and serve["ratio_to_offline"] > 0
    assert serve["cpu_s"]["engine thread"] > 0 and serve["cpu_s"]["worker event loop"] > 0
    assert report["paths"]["offline"]["ratio_to_offline"] == 1.0
    assert "CPU per output token" in proc.stdout


def test_several_rounds_report_each_paths_round_of_median_ratio():
    from benchmarks.serving_bench import _median_round

    def rnd(offline: float, serve: float) -> dict:
        return {"offline": {"output_tok_s": offline}, "serve": {"output_tok_s": serve}}

    # the machine drifts between rounds; each ratio is against its own round's offline
    rows = _median_round([rnd(800, 700), rnd(600, 590), rnd(790, 750)])
    assert rows["serve"]["round_ratios"] == pytest.approx([0.875, 590 / 600, 750 / 790])
    assert rows["serve"]["ratio_to_offline"] == pytest.approx(750 / 790)
    assert rows["serve"]["output_tok_s"] == 750 and rows["offline"]["ratio_to_offline"] == 1.0
    single = [rnd(800, 700)]
    assert _median_round(single) is single[0]
