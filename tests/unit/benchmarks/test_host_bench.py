"""`make bench-host`'s serve point: a real `baton serve` on the simulated device, measured
over the window in which every stream decodes (the worker's own counters, from /metrics)."""

from __future__ import annotations

from benchmarks import host_bench


def test_serve_is_measured_while_every_stream_decodes():
    (row,) = host_bench.serve("h100-llama3-8b", [3])
    assert row["batch"] == 3
    # a window of whole decode steps of all 3 streams: the modelled device busy most of it
    # (a step in flight counts whole at either end: a short window can read a little over 1)
    assert 0.5 < row["busy"] < 1.1
    assert row["tokens_per_s"] > 0 and row["worker_cpu_us_per_token"] > 0
    assert row["host_ms_per_step"] >= 0
    # no prefill in the window: each step gives every stream a token (the window's ends may
    # cut a step's tokens from its count)
    assert row["steps"] > 20 and abs(row["tokens"] - 3 * row["steps"]) <= 6
