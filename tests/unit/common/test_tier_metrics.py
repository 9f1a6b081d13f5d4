"""The host offload tier's stats on /metrics: every series, its kind, and promtool's lint."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from baton.common.metrics import ENGINE_SERIES, EngineCollector
from baton.common.stats import EngineStats, KVTierStats

TIER = KVTierStats(hit_blocks_total=3, hit_tokens_total=48, offloaded_bytes_total=4096,
                   loaded_bytes_total=2048, offload_skipped_total=1, blocks_held=5,
                   blocks_total=8, offload_queue_depth=2, disk_queue_depth=4,
                   disk_spills_dropped_total=6, disk_read_failures_total=7,
                   load_fallbacks_total=9, load_queue_blocks=11)


def scrape(stats: EngineStats) -> str:
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: stats))
    return generate_latest(registry).decode()


def test_the_tier_series_are_exported_only_with_a_tier():
    page = scrape(EngineStats(kv_tier=TIER))
    for name, value in TIER.series().items():
        assert name in ENGINE_SERIES
        kind = ENGINE_SERIES[name][0]
        shown = name.removesuffix("_total") + ("_total" if kind == "counter" else "")
        assert f"{shown} {float(value)}" in page
    assert "# TYPE baton:kv_offload_queue_depth gauge" in page
    assert "kv_offload" not in scrape(EngineStats())


def test_promtool_finds_nothing_but_the_colon_namespace():
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (make setup installs Debian's prometheus)")
    r = subprocess.run(["promtool", "check", "metrics"], input=scrape(EngineStats(kv_tier=TIER))
                       .encode(), capture_output=True, timeout=30)
    found = (r.stdout + r.stderr).decode().splitlines()
    tier = [ln for ln in found if "kv_offload" in ln and "should not contain ':'" not in ln]
    assert tier == []
