"""Live tuning: the file's schema, the watcher against a reproduction of kubelet's atomic
ConfigMap update, and the router applying a reload (torch-free parts only)."""

from __future__ import annotations

import os
import time

import pytest

from baton.common.tuning import (
    FILE_NAME,
    ConfigWatcher,
    Tuning,
    TuningError,
    load_tuning,
    parse_tuning,
)
from tests.kubelet import KubeletDir


def test_schema_names_bad_fields():
    t = parse_tuning("router: {disagg_min_prefill_tokens: 64}\nworker: {max_num_seqs: 4}")
    assert t.router.disagg_min_prefill_tokens == 64 and t.worker.max_num_seqs == 4
    assert parse_tuning("") == Tuning()
    for text, field in [("router: {max_attempts: 0}", "router.max_attempts"),
                        ("worker: {max_num_seqs: '4'}", "worker.max_num_seqs"),
                        ("worker: {tensor_parallel: 2}", "worker.tensor_parallel"),
                        ("worker: {restart: {dtype: int8}}", "worker.restart.dtype"),
                        ("- a list", "top level"), ("router: {", "YAML")]:
        with pytest.raises(TuningError, match=field.replace(".", r"\.")):
            parse_tuning(text)


def test_watcher_follows_kubelet_updates(tmp_path):
    vol = KubeletDir(tmp_path)
    vol.publish("worker: {max_num_seqs: 8}")
    applied, results = [], []

    def apply(new: Tuning, old: Tuning) -> list[str]:
        if new.worker.max_num_seqs == 999:
            raise TuningError("worker.max_num_seqs=999 is above the start value")
        applied.append((old.worker.max_num_seqs, new.worker.max_num_seqs))
        return ["dtype"] if new.worker.restart.dtype else []

    w = ConfigWatcher(tmp_path, apply, results.append)
    assert w.load_initial().worker.max_num_seqs == 8
    assert w.check() is None  # nothing changed
    vol.publish("worker: {max_num_seqs: 4}")
    assert w.check() == "applied" and applied == [(8, 4)]
    assert w.check() is None  # each update seen once
    vol.publish("worker: {max_num_seqs: [oops]}")  # invalid: rejected, old config stays
    assert w.check() == "rejected" and w.current.worker.max_num_seqs == 4
    vol.publish("worker: {max_num_seqs: 999}")  # valid YAML, refused by the service
    assert w.check() == "rejected" and w.current.worker.max_num_seqs == 4
    vol.publish("worker: {max_num_seqs: 2, restart: {dtype: float32}}")
    assert w.check() == "applied" and w.restart_pending == ["dtype"]
    assert results == ["applied", "rejected", "rejected", "applied"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("..2026")] == \
        [os.readlink(tmp_path / "..data")]  # kubelet removed the old versions


def test_watcher_on_a_plain_directory(tmp_path):
    results = []
    w = ConfigWatcher(tmp_path, lambda new, old: [], results.append)
    assert w.load_initial() == Tuning()  # no file yet: nothing to apply
    (tmp_path / FILE_NAME).write_text("router: {max_attempts: 2}")
    assert w.check() == "applied" and w.current.router.max_attempts == 2
    time.sleep(0.01)
    (tmp_path / FILE_NAME).write_text("router: {max_attempts: 5, idle_timeout_s: 3}")
    assert w.check() == "applied" and w.current.router.idle_timeout_s == 3
    (tmp_path / FILE_NAME).unlink()  # gone: rejected, the last config stays
    assert w.check() == "rejected" and w.current.router.max_attempts == 5


def test_router_applies_a_reload(tmp_path):
    from baton.router.app import Router, RouterSettings
    from baton.router.scheduling.context import RoutingContext
    from baton.router.scheduling.pipeline import RoutingPipeline

    r = Router(RouterSettings(workers=("http://127.0.0.1:1",), config_dir=str(tmp_path),
                              pinned=frozenset({"max_attempts"})))  # no I/O until lifespan
    s = r.settings
    forty = RoutingContext(model="m", prompt_tokens=40)  # what the decider decides on
    assert not r.tunables.disagg.decide(None, forty)  # the flag's 256
    r.apply_tuning(parse_tuning("router:\n  scorer_weights: {queue: 2, prefix: 0}\n"
                                "  disagg_min_prefill_tokens: 32\n  max_attempts: 9\n"
                                "  idle_timeout_s: 5"))
    t = r.tunables  # the one snapshot every request reads from now on
    assert t.pipeline.scorers == {"queue": 2.0, "prefix": 0.0}
    assert t.disagg.min_prefill_tokens == 32 and t.disagg.decide(None, forty)
    assert t.proxy.idle_timeout_s == 5
    assert t.proxy.max_attempts == 3  # pinned by a flag: the file does not win
    with pytest.raises(TuningError, match="unknown routing scorer"):
        r.apply_tuning(parse_tuning("router: {scorer_weights: {latency: 1}}"))
    assert r.tunables is t and t.disagg.min_prefill_tokens == 32  # unchanged
    r.apply_tuning(Tuning())  # fields dropped from the file go back to the flags' values
    assert r.tunables.disagg.min_prefill_tokens == s.disagg.min_prefill_tokens
    assert r.tunables.pipeline.scorers == RoutingPipeline.from_policy(s.policy).scorers
    assert r.tunables.proxy == s.proxy


def test_baton_config_validate(tmp_path, capsys):
    from baton.cli import main

    good = tmp_path / "good.yaml"
    good.write_text("router: {scorer_weights: {queue: 1}}\nworker: {restart: {dtype: float32}}")
    assert main(["config", "validate", str(good)]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("router: {scorer_weights: {latency: 1}}")
    assert main(["config", "validate", str(bad)]) == 2
    assert "unknown routing scorer" in capsys.readouterr().err
    assert load_tuning(good).worker.restart.dtype == "float32"
