"""The worker's live tuning: the file's worker section at start, and reloads handed to the
engine as `LiveSettings` (limits at most the start values; pinned flags win)."""

from __future__ import annotations

import pytest

from baton.common.metrics import WorkerMetrics
from baton.common.tuning import TuningError, parse_tuning
from baton.engine.config import EngineConfig, LiveKVSettings, LiveSettings, SchedulerConfig
from baton.worker.tuning import WorkerTuner, configure

START = EngineConfig.from_args(max_num_seqs=8, max_num_batched_tokens=512, kv_lease_ttl_s=30.0)


class RecordingEngine:
    def __init__(self) -> None:
        self.applied: list[LiveSettings] = []

    def reconfigure(self, live: LiveSettings) -> None:
        self.applied.append(live)


def make_tuner(pinned: frozenset[str] = frozenset()):
    engine, metrics = RecordingEngine(), WorkerMetrics()
    return WorkerTuner(engine, START, pinned, metrics), engine, metrics


def restart_pending(metrics: WorkerMetrics) -> float:
    return metrics.registry.get_sample_value("baton:config_restart_pending")


def test_a_reload_hands_the_live_knobs_to_the_engine():
    tuner, engine, metrics = make_tuner()
    assert tuner.apply(parse_tuning("worker: {max_num_seqs: 2, kv_failure_policy: fail}")) == []
    assert engine.applied == [LiveSettings(SchedulerConfig(512, 2), LiveKVSettings(
        30.0, START.kv_transfer.live.transfer_timeout_s, "fail"))]
    assert restart_pending(metrics) == 0


def test_knobs_the_file_leaves_out_go_back_to_the_start_values():
    tuner, engine, _ = make_tuner()
    tuner.apply(parse_tuning("worker: {max_num_seqs: 2}"))
    tuner.apply(parse_tuning("worker: {}"))
    assert engine.applied[-1] == START.live_settings


def test_raising_a_limit_above_the_start_value_is_refused():
    tuner, engine, _ = make_tuner()
    with pytest.raises(TuningError, match="worker.max_num_batched_tokens=1024 is above the "
                                          "512 .* needs a restart"):
        tuner.apply(parse_tuning("worker: {max_num_batched_tokens: 1024}"))
    assert engine.applied == []


def test_pinned_fields_keep_the_flags_value():
    tuner, engine, _ = make_tuner(frozenset({"max_num_seqs"}))
    tuner.apply(parse_tuning("worker: {max_num_seqs: 2, kv_lease_ttl_s: 5}"))
    live = engine.applied[0]
    assert (live.scheduler.max_num_seqs, live.kv.lease_ttl_s) == (8, 5.0)


def test_restart_knobs_are_reported_not_applied():
    tuner, engine, metrics = make_tuner()
    changed = tuner.apply(parse_tuning(
        "worker: {restart: {block_size: 32, dtype: bfloat16}}"))
    assert changed == ["block_size"]  # dtype is already bfloat16
    assert restart_pending(metrics) == 1
    assert engine.applied == [START.live_settings]


def test_configure_at_start_takes_the_file_under_the_flags():
    tuning = parse_tuning("worker: {max_num_seqs: 4, restart: {block_size: 32}}")
    cfg = configure(START, tuning, frozenset({"block_size"}))
    assert (cfg.scheduler.max_num_seqs, cfg.cache.block_size) == (4, START.cache.block_size)
    with pytest.raises(TuningError, match="worker: EngineConfig.block_size=3"):
        configure(START, parse_tuning("worker: {restart: {block_size: 3}}"), frozenset())


def test_speculation_is_turned_on_tuned_and_off_live():
    from baton.engine.spec.config import SpeculativeConfig

    tuner, engine, _ = make_tuner()
    tuner.apply(parse_tuning("worker: {speculative_config: {method: ngram, "
                             "num_speculative_tokens: 6}}"))
    assert engine.applied[-1].scheduler.speculative == SpeculativeConfig("ngram", 6)
    tuner.apply(parse_tuning("worker: {speculative_config: {method: null}}"))
    assert not engine.applied[-1].scheduler.speculative.enabled
    with pytest.raises(TuningError, match="num_speculative_tokens=99"):
        tuner.apply(parse_tuning("worker: {speculative_config: {method: ngram, "
                                 "num_speculative_tokens: 99}}"))
    with pytest.raises(TuningError, match="not built"):
        tuner.apply(parse_tuning("worker: {speculative_config: {method: eagle}}"))
    with pytest.raises(TuningError, match="needs a restart"):
        tuner.apply(parse_tuning("worker: {speculative_config: {method: draft_model, "
                                 "draft_model: /elsewhere}}"))
