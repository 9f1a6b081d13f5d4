"""`baton-loadtest` end to end against `baton up`: the JSON, the table and the PNGs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TINY = """
name: tiny
seed: 1
num_requests: 6
prompt_tokens: {dist: lognormal, median: 40, sigma: 0.5, min: 8, max: 120}
output_tokens: {dist: uniform, min: 4, max: 12}
arrival: {process: poisson, rate: 4.0}
"""


def loadtest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton_loadtest.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_run_writes_json_table_and_plots(cluster, tmp_path):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    out = tmp_path / "run"
    r = loadtest("run", "--base-url", cluster.router, "--workload", str(wl), "--out", str(out),
                 "--slo-ttft", "30", "--slo-itl", "30", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    s = result["summary"]
    assert s["requests"] == s["ok"] == 6 and s["errors"] == 0
    assert s["good"] == 6 and s["goodput"] > 0
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert s[key]["count"] > 0 and 0 < s[key]["p50"] <= s[key]["p99"]
    recs = result["requests"]
    assert all(4 <= x["output_tokens"] <= 12 for x in recs)  # ignore_eos: exact lengths
    assert all(x["prompt_tokens"] >= 8 for x in recs)
    assert "| TTFT (ms) |" in (out / "summary.md").read_text()
    for png in ("latency_cdf.png", "inflight.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    r = loadtest("compare", str(out / "result.json"), str(out / "result.json"))
    assert r.returncode == 0 and "1.00x" in r.stdout


def test_sweep_finds_a_rate_and_plots(cluster, tmp_path):
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY.replace("num_requests: 6", "num_requests: 4"))
    out = tmp_path / "sweep"
    r = loadtest("sweep", "--base-url", cluster.router, "--workload", str(wl), "--out",
                 str(out), "--rates", "1,2", "--slo-ttft", "30", "--no-progress",
                 "--api", "completions")
    assert r.returncode == 0, r.stderr[-2000:]
    sweep = json.loads((out / "sweep.json").read_text())
    assert [row["offered_rate"] for row in sweep["rows"]] == [1.0, 2.0]
    assert sweep["max_good_rate"] is not None
    assert (out / "sweep.png").exists() and (out / "rate_1" / "result.json").exists()
