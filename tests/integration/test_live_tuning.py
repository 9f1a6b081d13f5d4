"""Live tuning of a real worker from a ConfigMap-like directory updated the kubelet way: the
scheduler limit changes without a restart, invalid or too-large values are rejected and the
old config stays, restart-only knobs say so."""

from __future__ import annotations

import json
import threading

import pytest

from tests.integration.conftest import (
    MODEL,
    Proc,
    assert_idle,
    free_port_run,
    http_get,
    metric_value,
    post_json,
    wait_for,
)
from tests.kubelet import KubeletDir

pytestmark = pytest.mark.slow


def reloads(url: str, result: str) -> float:
    return metric_value(url, f'baton:config_reloads_total{{result="{result}"}}', 0)


def test_worker_takes_live_scheduler_limits(tmp_path):
    vol = KubeletDir(tmp_path / "tuning")
    vol.root.mkdir()
    vol.publish("worker: {max_num_seqs: 4}")
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    worker = Proc(["serve", "--port", str(port), "--dtype", "float32", "--num-kv-blocks",
                   "256", "--num-threads", "1", "--config-dir", str(vol.root)],
                  tmp_path / "worker.log").start()
    try:
        worker.wait_ready(url)
        vol.publish("worker: {max_num_seqs: 1}")
        wait_for(lambda: reloads(url, "applied") == 1, 10, "the reload to apply")
        peak = {"running": 0, "waiting": 0}
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                code, body = http_get(url + "/load", 1)
                if code == 200:
                    load = json.loads(body)
                    peak["running"] = max(peak["running"], load["running"])
                    peak["waiting"] = max(peak["waiting"], load["waiting"])

        def ask():
            code, _, _ = post_json(url + "/v1/completions", {
                "model": MODEL, "prompt": "Count to twenty:", "max_tokens": 24,
                "ignore_eos": True})
            assert code == 200

        watcher = threading.Thread(target=watch)
        watcher.start()
        clients = [threading.Thread(target=ask) for _ in range(3)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(60)
        stop.set()
        watcher.join()
        assert peak["running"] == 1 and peak["waiting"] >= 1, peak  # one at a time now

        vol.publish("worker: {max_num_seqs: 16}")  # above the start value: needs a restart
        wait_for(lambda: reloads(url, "rejected") == 1, 10, "the too-large value rejected")
        vol.publish("worker: {max_num_seqs: [")  # not YAML
        wait_for(lambda: reloads(url, "rejected") == 2, 10, "the broken file rejected")
        assert "config reload rejected" in (tmp_path / "worker.log").read_text()
        vol.publish("worker: {max_num_seqs: 2, restart: {block_size: 32}}")
        wait_for(lambda: reloads(url, "applied") == 2, 10, "the next valid file")
        assert metric_value(url, "baton:config_restart_pending") == 1
        assert "needs a restart to take effect: block_size" in \
            (tmp_path / "worker.log").read_text()
        assert post_json(url + "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                   "max_tokens": 2})[0] == 200
        assert_idle([url])
    finally:
        assert worker.stop()


def test_invalid_file_at_start_is_a_clear_exit(tmp_path):
    vol = KubeletDir(tmp_path)
    vol.publish("worker: {max_num_seqs: zero}")
    port = free_port_run(1)
    proc = Proc(["serve", "--port", str(port), "--config-dir", str(tmp_path)],
                tmp_path / "w.log").start()
    assert proc.proc.wait(60) == 2
    proc._log.close()
    assert "worker.max_num_seqs" in (tmp_path / "w.log").read_text()
