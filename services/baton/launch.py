"""`baton up`: a local cluster of real processes on loopback.

Starts N workers (`baton serve`, ports port+1..port+N, the CPU cores split between them),
waits until each is ready, then the router on `port`, prints how to call it, and waits.
It supervises them as Kubernetes would: a process that exits is logged and started again
after a backoff (1 s, doubling to 30 s; reset once it has run a minute), and the others
keep serving meanwhile. Ctrl-C or SIGTERM stops the router first, then the workers
(SIGTERM, SIGKILL after a grace period). Children also get SIGKILL from the kernel if this
process dies without cleaning up (PR_SET_PDEATHSIG), so nothing outlives it.
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
from baton.gpus import plan_gpus, visible_gpus

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
    prefill_tp: int = 1  # tensor-parallel ranks of each prefill / decode worker
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.num_prefill or self.num_decode:
            if self.num_prefill < 1 or self.num_decode < 1:
                raise ValueError("--prefill and --decode must both be >= 1")
            self.num_workers = self.num_prefill + self.num_decode
        elif (self.prefill_tp, self.decode_tp) != (1, 1):
            raise ValueError("--prefill-tp / --decode-tp size disaggregated workers (--prefill"
                             " N --decode M); colocated workers take --tensor-parallel-size")
        if min(self.prefill_tp, self.decode_tp) < 1:
            raise ValueError("--prefill-tp and --decode-tp must be >= 1")
        transport = _flag(self.worker_args, "--kv-transport")
        if max(self.prefill_tp, self.decode_tp) > 1 and transport not in (None, "tcp"):
            raise ValueError(f"--prefill-tp / --decode-tp > 1 with --kv-transport "
                             f"{transport}: KV transfer between tensor-parallel pods runs "
                             "over tcp only")
        if self.num_workers < 1:
            raise ValueError(f"--workers={self.num_workers} must be >= 1")
        self.procs: list[_Child] = []

    @property
    def roles(self) -> list[Role]:
        """Each worker's role, in port order: prefill workers before decode workers."""
        if not self.num_prefill:
            return [Role.BOTH] * self.num_workers
        return [Role.PREFILL] * self.num_prefill + [Role.DECODE] * self.num_decode

    @classmethod
    def from_args(cls, args) -> Cluster:
        """The cluster `baton up`'s parsed flags describe: every worker flag (the engine's
        and the worker's, `cli_common.WORKER_FLAGS`) given a value other than its default
        is passed on to every worker; `--policy`, `--disagg-min-prefill-tokens` and the peer
        fetch flags to the router."""
        from baton.cli_common import worker_flag_args

        router_args = ["--policy", args.policy, "--disagg-min-prefill-tokens",
                       str(args.disagg_min_prefill_tokens),
                       "--peer-fetch" if args.peer_fetch else "--no-peer-fetch",
                       "--peer-fetch-min-tokens", str(args.peer_fetch_min_tokens)]
        return cls(args.host, args.port, args.workers, worker_flag_args(args), router_args,
                   args.ready_timeout, args.log_level, args.prefill, args.decode,
                   args.prefill_tp, args.decode_tp)

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
            self._supervise(stop)
            print("\nbaton up: stopping", file=sys.stderr)
            return 0
        except (_Aborted, TimeoutError, ValueError) as err:  # ValueError: no GPU placement
            print(f"baton up: {err}", file=sys.stderr)
            return 0 if stop.requested else 1
        finally:
            self.stop()
            stop.restore()

    def _supervise(self, stop: _StopSignal) -> None:
        """Until stopped: start again each process that exited, after its backoff."""
        while not stop.requested:
            now = time.monotonic()
            for i, child in enumerate(self.procs):
                if child.proc.poll() is None:
                    if now - child.started > RESTART_RESET_S:
                        child.backoff_s = RESTART_BACKOFF_S
                    continue
                if child.restart_at is None:
                    print(f"baton up: {child.name} exited with code {child.proc.returncode}; "
                          f"restarting it in {child.backoff_s:.0f}s", file=sys.stderr)
                    child.restart_at = now + child.backoff_s
                elif now >= child.restart_at:
                    self.procs[i] = self._start_process(child.name, child.args,
                                                        min(child.backoff_s * 2,
                                                            RESTART_BACKOFF_MAX_S), child.env)
            time.sleep(0.5)

    def tp_args(self, role: Role) -> list[str]:
        """The tensor-parallel flag a worker of `role` gets beyond `worker_args`."""
        tp = {Role.PREFILL: self.prefill_tp, Role.DECODE: self.decode_tp}.get(role, 1)
        # pods of any TP degree > 1 and their peers meet over tcp (`kv_transfer/tcp.py`)
        tcp = [] if "--kv-transport" in self.worker_args or role == Role.BOTH or max(
            self.prefill_tp, self.decode_tp) == 1 else ["--kv-transport", "tcp"]
        return (["--tensor-parallel-size", str(tp)] if tp > 1 else []) + tcp

    def start(self, stop: _StopSignal | None = None) -> None:
        ranks = [_ranks(self.worker_args + self.tp_args(r)) for r in self.roles]
        threads = max(1, (os.cpu_count() or 1) // sum(ranks))  # per rank: cores split over all
        extra = [] if "--num-threads" in self.worker_args else ["--num-threads", str(threads)]
        gpus = (plan_gpus(ranks, visible_gpus(), self.worker_args)
                if _flag(self.worker_args, "--device") == "cuda" else None)
        if gpus is not None:
            extra += gpus.args()
        for i, (url, role) in enumerate(zip(self.worker_urls, self.roles)):
            name = f"worker-{i + 1}" if role == Role.BOTH else f"{role.value}-{i + 1}"
            self._spawn(name, ["serve", "--host", self.host, "--port", str(self.port + 1 + i),
                               "--role", role.value,
                               *_kv_port_of(self.worker_args, i,
                                            max(self.prefill_tp, self.decode_tp)),
                               *self.tp_args(role), *extra],
                        gpus.env(i) if gpus is not None else None)
            if gpus is not None and gpus.shared:  # each profiles what the others hold
                self._wait_ready(name, self.procs[-1].proc, url, stop)
        for url, child in zip(self.worker_urls, self.procs):
            self._wait_ready(child.name, child.proc, url, stop)
        self._spawn("router", ["router", "--host", self.host, "--port", str(self.port),
                               "--workers", ",".join(self.worker_urls), *self.router_args])
        self._wait_ready("router", self.procs[-1].proc, self.router_url, stop)

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.procs.append(self._start_process(name, args, RESTART_BACKOFF_S, env))

    def _start_process(self, name: str, args: list[str], backoff_s: float,
                       env: dict[str, str] | None = None) -> _Child:
        """`env`: variables set for this child beyond ours (its GPUs)."""
        cmd = [sys.executable, "-m", "baton.cli", *args, "--name", name,
               "--log-level", self.log_level]
        proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent,
                                env=None if env is None else {**os.environ, **env})
        return _Child(name, args, proc, time.monotonic(), backoff_s, env)

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
        for child in reversed(self.procs):
            proc = child.proc
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                print(f"baton up: {child.name} ignored SIGTERM; killing it", file=sys.stderr)
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


RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_RESET_S = 60.0  # up this long: the next exit starts from the first backoff again


@dataclass
class _Child:
    """A supervised process: how to start it again and when."""

    name: str
    args: list[str]
    proc: subprocess.Popen
    started: float
    backoff_s: float
    env: dict[str, str] | None = None  # beyond ours: the child's GPUs
    restart_at: float | None = None


def _ranks(worker_args: list[str]) -> int:
    """The tensor-parallel ranks (processes) of a worker started with `worker_args`."""
    at = [i for i, arg in enumerate(worker_args) if arg == "--tensor-parallel-size"]
    return int(worker_args[at[-1] + 1]) if at else 1  # the last one given wins


def _flag(args: list[str], name: str) -> str | None:
    at = [i for i, arg in enumerate(args[:-1]) if arg == name]
    return args[at[-1] + 1] if at else None


def _kv_port_of(worker_args: list[str], i: int, ranks: int = 1) -> list[str]:
    """`worker_args` for worker `i`: a fixed `--kv-port P` becomes P + i * ranks (one port
    per tensor-parallel rank each: rank r of a worker listens on its port + r)."""
    if "--kv-port" not in worker_args:
        return worker_args
    args = list(worker_args)
    at = args.index("--kv-port") + 1
    if int(args[at]) != 0:
        args[at] = str(int(args[at]) + i * ranks)
    return args


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
