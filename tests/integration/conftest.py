"""Real processes on loopback: `baton up` (router + 2 workers) on the bundled model, fp32 so
that greedy text matches the in-process reference exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from benchmarks.procs import free_port_run  # noqa: F401 - used by the tests

MODEL = "SmolLM2-135M-Instruct"
WORKER_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "384", "--max-num-seqs", "16"]


def http_get(url: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return None, b""


def metric_value(base_url: str, name: str, default: float | None = None) -> float:
    """A sample's value; `default` for a labelled series not created yet (else KeyError)."""
    _, page = http_get(base_url + "/metrics")
    for line in page.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise KeyError(name)


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Proc:
    """A `baton ...` subprocess with its log in a file; stopped with SIGTERM."""

    args: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    extra_env: dict = field(default_factory=dict)

    def start(self) -> "Proc":
        self._log = open(self.log_path, "wb")
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | self.extra_env
        self.proc = subprocess.Popen([sys.executable, "-m", "baton.cli", *self.args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, url: str, timeout: float = 180.0) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.args[0]} exited {self.proc.returncode}:\n"
                                     + self.log_path.read_text()[-3000:])
            return http_get(url + "/ready", 2)[0] == 200
        wait_for(ready, timeout, f"{url}/ready", 0.25)

    def stop(self, timeout: float = 60.0) -> bool:
        """SIGTERM; True when it exited cleanly (a worker drains: in-flight work and held
        leases get up to its --drain-timeout, 30 s; a second signal's exit, -SIGTERM,
        counts as clean too)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired as err:
            self.proc.kill()
            rc = self.proc.wait()
            raise AssertionError(f"{self.args[0]} ignored SIGTERM for {timeout}s") from err
        finally:
            self._log.close()
        return rc in (0, -signal.SIGTERM)


@dataclass
class Cluster:
    router: str
    workers: list[str]
    proc: Proc


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    port = free_port_run(3)
    log = tmp_path_factory.mktemp("cluster") / "up.log"
    up = Proc(["up", "--port", str(port), "--workers", "2", *WORKER_FLAGS], log).start()
    c = Cluster(f"http://127.0.0.1:{port}",
                [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"], up)
    up.wait_ready(c.router, timeout=300)
    for w in c.workers:
        up.wait_ready(w, timeout=10)
    yield c
    assert up.stop(), log.read_text()[-3000:]
    # Ctrl-C semantics: nothing is left listening.
    for url in [c.router, *c.workers]:
        assert http_get(url + "/health", 1)[0] is None, f"{url} still answers after stop"


@pytest.fixture(scope="session")
def reference_llm():
    from baton import LLM

    return LLM(dtype="float32", num_kv_blocks=384)


@pytest.fixture
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.router + "/v1", api_key="unused", max_retries=0,
                  timeout=120)


def kv_blocks_used(url: str) -> float:
    return metric_value(url, "baton:kv_blocks_used")


def assert_idle(urls: list[str], timeout: float = 15.0) -> None:
    """Every worker drains to zero running requests and zero used KV blocks."""
    for url in urls:
        wait_for(lambda url=url: kv_blocks_used(url) == 0
                 and metric_value(url, "baton:num_requests_running") == 0,
                 timeout, f"{url} to hold zero blocks")


def promtool() -> str | None:
    return shutil.which("promtool")


def post_json(url: str, body: dict | bytes, timeout: float = 60.0):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            if r.headers.get_content_type() == "text/event-stream":
                return r.status, r.headers, raw.decode()  # SSE: the raw events
            return r.status, r.headers, json.loads(raw or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, e.headers, json.loads(raw) if raw else None
