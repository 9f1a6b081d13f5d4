"""`baton serve` with its engine core in its own process (`--engine-process`, on by default
for the simulated device): it serves, a SIGTERM stops both processes cleanly, and a core
that dies ends the worker with exit code 1 (its supervisor restarts it) instead of leaving
it up with no engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from benchmarks.gpu_pieces import children_of
from benchmarks.procs import free_port, wait_ready

pytestmark = pytest.mark.slow


def _serve(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--port", str(port),
                             "--device", "sim", "--sim-profile", "h100-llama3-8b",
                             "--served-model-name", "sim", "--log-level", "warning", *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def _complete(url: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "sim", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _stopped(proc: subprocess.Popen, pids: list[int], timeout: float = 60) -> int:
    code = proc.wait(timeout)
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids):
        assert time.monotonic() < deadline, f"the engine core {pids} outlived its worker"
        time.sleep(0.1)
    return code


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_the_core_serves_apart_and_stops_with_the_worker():
    proc, url = _serve()
    try:
        cores = children_of(proc.pid)
        assert len(cores) == 1  # the engine core, in its own process
        out = _complete(url, 7)
        assert out["usage"]["completion_tokens"] == 7
        proc.send_signal(signal.SIGTERM)
        assert _stopped(proc, cores) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_core_ends_the_worker_with_exit_code_1():
    proc, url = _serve("--engine-process", "on")
    try:
        (core,) = children_of(proc.pid)
        os.kill(core, signal.SIGKILL)
        assert proc.wait(60) == 1
    finally:
        proc.kill()
        proc.wait()
