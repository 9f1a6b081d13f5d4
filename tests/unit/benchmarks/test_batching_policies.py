"""batching_policies on the simulated device, a small cut: every policy serves the whole
workload, only the static baselines compute padding, and continuous batching answers first."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from benchmarks.batching_policies import make_workload, run_policy

pytestmark = pytest.mark.slow  # three engines (the bundled tokenizer each)


def test_the_three_policies_serve_the_workload_and_only_the_baselines_pad():
    args = argparse.Namespace(device="sim", profile="h100-llama3-8b", requests=24, rate=400.0,
                              max_num_seqs=8, window_ms=20.0, max_output=48, threads=None,
                              seed=0)
    workload = make_workload(args)
    rows = {p: asyncio.run(run_policy(p, args, workload)) for p in ("static", "dynamic", "fcfs")}
    tokens = sum(r.max_tokens for r in workload)
    for row in rows.values():
        assert abs(row["tokens_per_s"] * row["wall_s"] - tokens) < 1e-6 * tokens
    assert rows["fcfs"]["padded_share"] == 0
    assert rows["static"]["padded_share"] > 0.1 and rows["dynamic"]["padded_share"] > 0.1
    assert rows["fcfs"]["ttft_p50_ms"] < rows["static"]["ttft_p50_ms"]
