"""Tensor parallelism over processes: rank 0 (the engine's own process) drives ranks
1..N-1, each a child process (`tp_worker.py`) holding its slice of the weights and of the KV
heads.

Rank 0 spawns the followers, meets them in a process group (gloo on CPU, NCCL on CUDA) over
a TCPStore on loopback at a port the OS picks, and then, every step, writes the flat batch
to each follower's stdin (`tp_wire.StepMessage`) before running the same forward: the
model's collectives (all-reduce after attention and MLP, the vocabulary all-gather of the
logits) pair up rank by rank. Only rank 0 samples.

Failure ends the pod, never hangs it: a follower that exits is seen by a watcher thread
within `WATCH_INTERVAL_S` (the next step raises `TPWorkerDied`, and `on_failure` callbacks
wake an idle engine loop so that it dies too); a collective with a dead peer fails at once
(gloo: connection closed) or after `COLLECTIVE_TIMEOUT_S`. A follower that is alive but makes
no progress (SIGSTOP, a hung collective) is seen by the same watcher: a step not finished
within `ParallelConfig.step_timeout_s` fails the engine like a death (`TPWorkerDied`, the
`on_failure` callbacks), and the followers are killed, which ends rank 0's pending
collective at once. Followers exit when their stdin
closes (rank 0 gone) or their parent changes (`tp_worker.py`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError

from baton.engine.config import EngineConfig
from baton.engine.distributed import TPGroup, set_tp_group, tp_group
from baton.engine.runner.batch import FlatBatch
from baton.engine.runner.tp_kv_messages import REPLY, KVControl, KVReply
from baton.engine.runner.tp_wire import Control, FollowerSpec, StepMessage, stop_frame

log = logging.getLogger(__name__)

# A collective waits this long for a peer that is alive but stuck (a dead one fails at once).
COLLECTIVE_TIMEOUT_S = 120.0
# How long followers may take to load their weights (they are watched while loading).
READY_TIMEOUT_S = 3600.0
WATCH_INTERVAL_S = 0.2
STOP_GRACE_S = 10.0


class TPWorkerDied(RuntimeError):
    """A tensor-parallel rank exited or stopped answering: this engine cannot run another
    step. `fatal`: the engine core ends at once instead of retrying steps."""

    fatal = True


def make_process_group(store, rank: int, size: int, device: torch.device,
                       timeout_s: float = COLLECTIVE_TIMEOUT_S):
    """A process group of its own (not torch's global default one, so that several engines
    can live in one process): NCCL on CUDA, gloo elsewhere. Blocks until every rank joins."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    pg = dist.ProcessGroup(store, rank, size)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, size, opts)
        kind = dist.ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
    pg._register_backend(device, kind, backend)
    pg._set_default_backend(kind)
    return pg


@contextmanager
def building_in(group: TPGroup):
    """Models built inside are built for `group` (their layers read `tp_group()`)."""
    before = tp_group()
    set_tp_group(group)
    try:
        yield
    finally:
        set_tp_group(before)


def start_tensor_parallel(config: EngineConfig, model_dir: Path, max_model_len: int,
                          device: torch.device, tp: TPGroup | None
                          ) -> tuple[TPLeader | None, TPGroup]:
    """The runner's leader (rank 0 of a tensor-parallel engine: followers spawned) or None,
    and the group its model is built in. `tp`: a follower's group, given (no leader)."""
    if tp is not None:
        return None, tp
    if config.parallel.tensor_parallel_size == 1:
        return None, TPGroup()
    size = config.parallel.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"EngineConfig.tensor_parallel_size={size} "
                         f"needs one GPU per rank; {torch.cuda.device_count()} visible")
    leader = TPLeader.start(config, model_dir, max_model_len, device)
    torch.set_num_threads(threads_per_rank(config))
    return leader, leader.group


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads each rank computes with: the configured count, else the cores split."""
    per_rank = (os.cpu_count() or 1) // config.parallel.tensor_parallel_size
    return config.compute.num_threads or max(1, per_rank)


class TPLeader:
    """Rank 0's handle on its followers. Called from the engine thread (`send_step`,
    `close`) and the watcher thread (which only records a death and calls `on_failure`)."""

    def __init__(self, procs: list[subprocess.Popen], group: TPGroup, store,
                 step_timeout_s: float = 120.0) -> None:
        self.procs = procs  # rank r is procs[r - 1]
        self.step_timeout_s = step_timeout_s
        self._step_since: float | None = None  # when the oldest step not read began
        self._unread: deque[float] = deque()  # launch times of steps not read yet
        self.group = group
        self._store = store  # rank 0 hosts it; followers' groups need it alive
        self.failure: TPWorkerDied | None = None
        self._callbacks: list[Callable[[TPWorkerDied], None]] = []
        self._closing = False
        self._closed = False
        self._lock = threading.Lock()
        self._reply_bufs = [b""] * len(procs)  # followers' stdout after the ready line
        self._watcher = threading.Thread(target=self._watch, name="baton-tp-watch",
                                         daemon=True)
        self._watcher.start()
        atexit.register(self.close)  # an LLM nobody closed: no follower outlives us

    @classmethod
    def start(cls, config: EngineConfig, model_dir: Path, max_model_len: int,
              device: torch.device) -> TPLeader:
        """Spawn ranks 1..N-1 and meet them in a process group (rank 0 here)."""
        import torch.distributed as dist

        size = config.parallel.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                              wait_for_workers=False)
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, size):
                procs.append(_spawn(FollowerSpec.make(rank, size, store.port, model_dir,
                                                      max_model_len, config)))
            pg = make_process_group(store, 0, size, device)
        except BaseException:
            _kill(procs)
            raise
        log.info("tensor parallel: %d ranks (followers pids %s)", size,
                 [p.pid for p in procs])
        return cls(procs, TPGroup(0, size, pg), store, config.parallel.step_timeout_s)

    def on_failure(self, callback: Callable[[TPWorkerDied], None]) -> None:
        """Call `callback(error)` (from the watcher thread) when a follower dies; at once if
        one already has."""
        with self._lock:
            self._callbacks.append(callback)
            failure = self.failure
        if failure is not None:
            callback(failure)

    def wait_ready(self, num_blocks: int, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait for every follower's ready line (weights loaded, KV cache allocated) and
        check that its KV pool has `num_blocks` blocks like rank 0's."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            line = _read_line(proc, deadline, rank)
            ready = json.loads(line)
            if ready.get("num_blocks") != num_blocks:
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} has {ready.get('num_blocks')}"
                                   f" KV blocks, rank 0 {num_blocks}: their configs differ")

    def send_step(self, batch: FlatBatch, logits_calls: list[np.ndarray]) -> None:
        """Hand one step to every follower (before rank 0 runs its forward). Raises
        TPWorkerDied if one has died."""
        self.raise_if_failed()
        frame = StepMessage.from_batch(batch, logits_calls).encode()
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.stdin.write(frame)
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as err:
                raise self._died(rank, proc, f"its pipe broke ({err})") from err

    @contextmanager
    def stepping(self, batch: FlatBatch, logits_calls: list[np.ndarray]):
        """Hand the step to the followers (`send_step`) and time rank 0's part of it, which
        the watcher bounds by `step_timeout_s`."""
        self.launch(batch, logits_calls)
        try:
            yield
        finally:
            self.landed()

    def launch(self, batch: FlatBatch, logits_calls: list[np.ndarray]) -> None:
        """Hand a step to the followers; the watcher bounds it by `step_timeout_s` from now
        until `landed` (a step launched ahead is read after the next one launches: the
        oldest unread step's launch is what the watcher times)."""
        self.send_step(batch, logits_calls)
        self._unread.append(time.monotonic())
        self._step_since = self._unread[0]

    @contextmanager
    def launching(self, batch: FlatBatch, logits_calls: list[np.ndarray]):
        """`launch`, then rank 0's part of the step; if that fails to launch, the step is
        never read: `landed` at once (the engine ends: a tensor-parallel step that fails
        is fatal)."""
        self.launch(batch, logits_calls)
        try:
            yield
        except BaseException:
            self.landed()
            raise

    def landed(self) -> None:
        """The oldest unread step has been read."""
        if self._unread:
            self._unread.popleft()
        self._step_since = self._unread[0] if self._unread else None

    def send_control(self, body: KVControl, ranks: list[int] | None = None) -> None:
        """A KV control message (`tp_wire.Control`) to `ranks` (default: every follower)."""
        self.raise_if_failed()
        frame = Control(body).encode()
        for rank in ranks or range(1, len(self.procs) + 1):
            proc = self.procs[rank - 1]
            try:
                proc.stdin.write(frame)
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as err:
                raise self._died(rank, proc, f"its pipe broke ({err})") from err

    def replies(self, timeout_s: float = 0.0) -> list[tuple[int, KVReply]]:
        """The followers' KV replies (JSON lines on their stdout, typed in
        `tp_kv_messages.py`) that have arrived, waiting up to `timeout_s` for the first;
        never blocks past that. A line that is not a reply is logged and dropped."""
        out: list[tuple[int, KVReply]] = []
        fds = {p.stdout.fileno(): r for r, p in enumerate(self.procs, start=1)
               if p.stdout is not None and not p.stdout.closed}
        ready, _, _ = select.select(list(fds), [], [], timeout_s) if fds else ([], [], [])
        for fd in ready:
            rank = fds[fd]
            chunk = os.read(fd, 1 << 16)
            buf = self._reply_bufs[rank - 1] + chunk
            *lines, self._reply_bufs[rank - 1] = buf.split(b"\n")
            for line in filter(bytes.strip, lines):
                try:
                    out.append((rank, REPLY.validate_json(line)))
                except ValidationError as err:
                    log.warning("rank %d sent a KV reply this version cannot read (%s): %.120r",
                                rank, err.errors()[0]["msg"], line)
        return out

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Stop the followers (the stop frame, then SIGKILL after STOP_GRACE_S); idempotent."""
        if self._closed:
            return
        self._closed = self._closing = True
        atexit.unregister(self.close)
        for proc in self.procs:
            try:
                proc.stdin.write(stop_frame())
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower pid %d did not stop; killing it", proc.pid)
        _kill(self.procs)
        for proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()

    # -- the watcher thread --------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self._closing:
                    self._fail(self._died(rank, proc,
                                          f"it exited with code {proc.returncode}"))
                    return
            since = self._step_since
            if since is not None and time.monotonic() - since > self.step_timeout_s \
                    and not self._closing:
                self._fail(self._stuck())
                _kill(self.procs)  # rank 0's collective with them fails now, not in minutes
                return
            time.sleep(WATCH_INTERVAL_S)

    def _fail(self, error: TPWorkerDied) -> None:
        log.error("%s", error)
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(error)

    def _stuck(self) -> TPWorkerDied:
        stopped = [rank for rank, proc in enumerate(self.procs, start=1) if _stopped(proc)]
        who = f"ranks {stopped} are stopped" if stopped else "a collective hung"
        with self._lock:
            if self.failure is None:
                self.failure = TPWorkerDied(
                    f"a tensor-parallel step made no progress for {self.step_timeout_s:g} s "
                    f"({who}); this engine cannot step any more and must be restarted")
            return self.failure

    def _died(self, rank: int, proc: subprocess.Popen, why: str) -> TPWorkerDied:
        with self._lock:
            if self.failure is None:
                self.failure = TPWorkerDied(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) is gone: {why}; this "
                    f"engine cannot step any more and must be restarted")
            return self.failure


def _spawn(spec: FollowerSpec) -> subprocess.Popen:
    """A follower process; its stdin takes the spec then step frames, its stdout gives one
    ready line, its stderr is ours (logs)."""
    proc = subprocess.Popen([sys.executable, "-m", "baton.engine.runner.tp_worker",
                             "--parent-pid", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
    proc.stdin.write(spec.to_line())
    proc.stdin.flush()
    return proc


def _read_line(proc: subprocess.Popen, deadline: float, rank: int) -> bytes:
    """One line of a follower's stdout before `deadline`, watching that it lives."""
    fd = proc.stdout.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        if proc.poll() is not None:
            raise TPWorkerDied(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                               f"{proc.returncode} while loading (its log is above)")
        if time.monotonic() > deadline:
            raise TPWorkerDied(f"tensor-parallel rank {rank} (pid {proc.pid}) was not ready "
                               "in time")
        ready, _, _ = select.select([fd], [], [], WATCH_INTERVAL_S)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:  # closed: it is exiting; the poll above reports how
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    raise TPWorkerDied(f"tensor-parallel rank {rank} (pid {proc.pid}) closed "
                                       "its stdout without exiting") from None
            buf += chunk
    return buf


def _stopped(proc: subprocess.Popen) -> bool:
    """Whether `proc` is stopped (SIGSTOP, a debugger): its /proc state is T or t."""
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("tensor-parallel follower pid %d survived SIGKILL", proc.pid)
