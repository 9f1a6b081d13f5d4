"""What gpu_check needs to run its pieces: a deadline, a subprocess in its own session with a
limit, the sweep that stops whatever a piece left running, the CUDA probe, the environment and
JUnit counts."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from baton.kv_transfer import NIXL_MODULES
from benchmarks.procs import tail

PR_SET_CHILD_SUBREAPER = 36
TERM_GRACE_S = 10.0


class Deadline:
    """One limit for the whole check, counted from its creation."""

    def __init__(self, total_s: float):
        self.total_s, self.started = total_s, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.total_s - self.elapsed()


def become_subreaper() -> bool:
    """Orphaned descendants (a `baton up` whose parent piece was killed) are re-parented to
    this process instead of init, so `sweep_orphans` can find and stop them. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children_of(pid: int) -> list[int]:
    """Process ids whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pids: list[int]) -> None:
    """SIGTERM, a grace period, then SIGKILL for what is left; those that are our children
    reaped (no other child's exit status is taken)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (TERM_GRACE_S if sig == signal.SIGTERM else 5)
        while time.monotonic() < deadline:
            reap(pids)
            if not [p for p in pids if alive(p)]:
                return
            time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (its own parent reaps it), or gone
            pass


def sweep_orphans(before: set[int]) -> list[int]:
    """Stops every process descending from this one that was not there `before` the piece
    (its leftovers: servers, workers, rank processes); returns their ids."""
    left = [pid for pid in descendants(os.getpid()) if pid not in before]
    if left:
        kill_tree(left)
    return left


def run_subprocess(cmd: list[str], log: Path, timeout_s: float, env: dict, cwd: Path) -> dict:
    """`cmd` in a session of its own, output to `log`, stopped (its whole tree) at the limit.
    The result's status: ok (exit 0), failed (another exit), timeout."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree([proc.pid, *descendants(proc.pid)])
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # stuck in the driver: reported, not waited on
                pass
            return {"status": "timeout", "error": f"ran past its {timeout_s:.0f} s limit",
                    "log": str(log), "log_tail": tail(log)}
    result = {"status": "ok" if code == 0 else "failed", "returncode": code, "log": str(log)}
    if code != 0:
        result["log_tail"] = tail(log)
    return result


def cuda_probe() -> dict:
    """Runs a matmul on a CUDA tensor and checks the value read back: the proof that work
    really ran on the device (not a CPU fallback, not Triton's interpreter)."""
    if not torch.cuda.is_available():
        return {"cuda_ran": False, "reason": "no CUDA device: torch.cuda.is_available() is "
                f"False (torch {torch.__version__}, built for CUDA {torch.version.cuda})"}
    try:
        a = torch.arange(1, 1025, device="cuda", dtype=torch.float32).reshape(32, 32)
        b = torch.eye(32, device="cuda") * 2
        c = a @ b
        torch.cuda.synchronize()
        ran = c.is_cuda and c.sum().item() == 2 * sum(range(1, 1025))
        return {"cuda_ran": bool(ran), "device": str(c.device),
                "device_count": torch.cuda.device_count(),
                "reason": None if ran else "the CUDA result read back was wrong"}
    except RuntimeError as err:
        return {"cuda_ran": False, "reason": f"a CUDA op failed: {err}"}


def environment() -> dict:
    """Versions and devices: what the report's numbers were measured on."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [{"name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
               for i in range(count)]
    nixl = [m for m in NIXL_MODULES if importlib.util.find_spec(m)]
    return {"python": sys.version.split()[0], "torch": str(torch.__version__),
            "torch_cuda": torch.version.cuda, "triton": triton_version,
            "transformers": transformers_version, "nixl": nixl,
            "cuda_available": torch.cuda.is_available(), "device_count": count,
            "devices": devices, "driver": driver_version(), "cpus": os.cpu_count()}


def driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped, the skip reasons and each test's outcome, from a
    JUnit XML file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons: dict[str, int] = {}
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case
                        if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(outcome,
                                                                                "passed")
        counts[key] += 1
        outcomes[case.get("name", "?")] = key
        if outcome == "skipped":
            reason = case.find("skipped").get("message", "")
            reasons[reason] = reasons.get(reason, 0) + 1
    return {**counts, "skip_reasons": reasons, "tests": outcomes}


MORE_GPUS = re.compile(r"needs (\d+) GPUs")


def unexpected_skips(reasons: dict[str, int], device_count: int) -> int:
    """The skips a GPU run must not have: all of them but those of tests that need more GPUs
    than the machine has (their reason says "needs N GPUs")."""
    return sum(n for reason, n in reasons.items()
               if not ((m := MORE_GPUS.search(reason)) and int(m.group(1)) > device_count))
