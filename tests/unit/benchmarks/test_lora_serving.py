"""lora_serving's pure helpers: the alternating windows, and inter-token gaps counted in the
window of their later event."""

from __future__ import annotations

import math

import pytest

from benchmarks.lora_serving import by_window, percentile, windows


def test_windows_alternate_quiet_and_loading_with_a_guard_between():
    assert windows(100.0, 5.0, 2, guard=1.0) == [
        (100.0, 105.0, "quiet"), (106.0, 111.0, "loading"),
        (112.0, 117.0, "quiet"), (118.0, 123.0, "loading")]


def test_gaps_count_in_the_window_of_their_later_event_and_skip_the_guard():
    wins = windows(0.0, 1.0, 1, guard=1.0)  # quiet [0, 1), loading [2, 3)
    responses = [[0.1, 0.3, 0.9, 1.5, 2.1, 2.4], [2.5, 2.6], [-0.5, 3.2]]
    quiet, loading = by_window(responses, wins)
    assert quiet["events"] == 3
    assert quiet["gaps"] == pytest.approx([0.2, 0.6])  # 0.1 starts its response
    assert loading["events"] == 4
    # 1.5 -> 2.1 ends in loading; 2.5 opens its response (no gap); -0.5 -> 3.2 ends nowhere
    assert loading["gaps"] == pytest.approx([0.6, 0.3, 0.1])


def test_percentile_is_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.5) == 51.0  # round(0.5 * 99) = 50 -> the 51st
    assert percentile(xs, 0.99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 1.0) == 3.0
    assert math.isnan(percentile([], 0.5))
