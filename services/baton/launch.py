"""`baton up`: a local cluster of real processes on loopback.

Starts N workers (`baton serve`, ports port+1..port+N, the CPU cores split between them),
waits until each is ready, then the router on `port`, prints how to call it, and waits.
Ctrl-C or SIGTERM stops the router first, then the workers (SIGTERM, SIGKILL after a grace
period). Children also get SIGKILL from the kernel if this process dies without cleaning
up (PR_SET_PDEATHSIG), so nothing outlives it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from baton.common.roles import Role

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclass
class Cluster:
    """A local cluster: `num_workers` colocated workers, or `num_prefill` prefill and
    `num_decode` decode workers, on ports port+1.. behind a router on `port`. `worker_args`
    and `router_args` are extra `baton serve` / `baton router` flags. Its defaults are
    `baton up`'s. Raises ValueError for worker counts that make no cluster."""

    host: str = "127.0.0.1"
    port: int = 8000
    num_workers: int = 2
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 600.0
    log_level: str = "info"
    num_prefill: int = 0  # > 0: disaggregated, num_prefill + num_decode workers
    num_decode: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill or self.num_decode:
            if self.num_prefill < 1 or self.num_decode < 1:
                raise ValueError("--prefill and --decode must both be >= 1")
            self.num_workers = self.num_prefill + self.num_decode
        if self.num_workers < 1:
            raise ValueError(f"--workers={self.num_workers} must be >= 1")
        self.procs: list[tuple[str, subprocess.Popen]] = []

    @property
    def roles(self) -> list[Role]:
        """Each worker's role, in port order: prefill workers before decode workers."""
        if not self.num_prefill:
            return [Role.BOTH] * self.num_workers
        return [Role.PREFILL] * self.num_prefill + [Role.DECODE] * self.num_decode

    @classmethod
    def from_args(cls, args) -> Cluster:
        """The cluster `baton up`'s parsed flags describe: the engine flags are passed on
        to every worker, `--policy` and `--disagg-min-prefill-tokens` to the router."""
        worker_args = ["--dtype", args.dtype, "--block-size", str(args.block_size),
                       "--max-num-seqs", str(args.max_num_seqs),
                       "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                       "--kv-cache-gib", str(args.kv_cache_gib),
                       "--scheduling-policy", args.scheduling_policy]
        for flag, value in (("--model", args.model), ("--max-model-len", args.max_model_len),
                            ("--num-kv-blocks", args.num_kv_blocks),
                            ("--served-model-name", args.served_model_name),
                            ("--num-threads", args.num_threads),
                            ("--max-waiting", args.max_waiting)):
            if value is not None:
                worker_args += [flag, str(value)]
        if args.no_prefix_caching:
            worker_args.append("--no-prefix-caching")
        if args.kv_transport:
            worker_args += ["--kv-transport", args.kv_transport]
        router_args = ["--policy", args.policy, "--disagg-min-prefill-tokens",
                       str(args.disagg_min_prefill_tokens)]
        return cls(args.host, args.port, args.workers, worker_args, router_args,
                   args.ready_timeout, args.log_level, args.prefill, args.decode)

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://{self.host}:{self.port + 1 + i}" for i in range(self.num_workers)]

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> int:
        stop = _StopSignal()
        try:
            self.start(stop)
            self._print_banner()
            while not stop.requested:
                for name, proc in self.procs:
                    if proc.poll() is not None:
                        print(f"baton up: {name} exited with code {proc.returncode}; "
                              "stopping the cluster", file=sys.stderr)
                        return 1
                time.sleep(0.5)
            print("\nbaton up: stopping", file=sys.stderr)
            return 0
        except (_Aborted, TimeoutError) as err:
            print(f"baton up: {err}", file=sys.stderr)
            return 0 if stop.requested else 1
        finally:
            self.stop()
            stop.restore()

    def start(self, stop: _StopSignal | None = None) -> None:
        threads = max(1, (os.cpu_count() or 1) // self.num_workers)
        extra = [] if "--num-threads" in self.worker_args else ["--num-threads", str(threads)]
        for i, (url, role) in enumerate(zip(self.worker_urls, self.roles)):
            name = f"worker-{i + 1}" if role == Role.BOTH else f"{role.value}-{i + 1}"
            self._spawn(name, ["serve", "--host", self.host, "--port", str(self.port + 1 + i),
                               "--role", role.value, *self.worker_args, *extra])
        for url, (name, proc) in zip(self.worker_urls, self.procs):
            self._wait_ready(name, proc, url, stop)
        self._spawn("router", ["router", "--host", self.host, "--port", str(self.port),
                               "--workers", ",".join(self.worker_urls), *self.router_args])
        self._wait_ready("router", self.procs[-1][1], self.router_url, stop)

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "baton.cli", *args, "--name", name,
               "--log-level", self.log_level]
        self.procs.append((name, subprocess.Popen(cmd, preexec_fn=_die_with_parent)))

    def _wait_ready(self, name: str, proc: subprocess.Popen, url: str,
                    stop: _StopSignal | None) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if stop is not None and stop.requested:
                raise _Aborted("interrupted while starting")
            if proc.poll() is not None:
                raise _Aborted(f"{name} exited with code {proc.returncode} while starting")
            if http_status(url + "/ready") == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(f"{name} at {url} was not ready after {self.ready_timeout_s:.0f}s")

    def stop(self, grace_s: float = 15.0) -> None:
        """Router first (no new work reaches workers), then the workers."""
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                print(f"baton up: {name} ignored SIGTERM; killing it", file=sys.stderr)
                proc.kill()
                proc.wait()
        self.procs.clear()

    def _print_banner(self) -> None:
        model = _model_name(self.router_url)
        url = self.router_url
        print(f"""
Baton is up: router {url} -> {", ".join(f"{r.value} {u}" for r, u in zip(self.roles, self.worker_urls))}
Model: {model}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python -c 'from openai import OpenAI; c = OpenAI(base_url="{url}/v1", api_key="-"); \\
print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], max_tokens=32).choices[0].message.content)'

Metrics: {url}/metrics and each worker's /metrics. Ctrl-C stops everything.
""", flush=True)


class _Aborted(Exception):
    pass


class _StopSignal:
    """SIGINT/SIGTERM set a flag instead of raising in the middle of process handling."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError):
        return None


def _model_name(router_url: str) -> str:
    try:
        with urllib.request.urlopen(router_url + "/v1/models", timeout=5) as resp:
            return json.load(resp)["data"][0]["id"]
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError):
        return "?"
