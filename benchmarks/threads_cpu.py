"""CPU time per thread role of a process tree, from /proc (Linux).

`cpu_by_role(pids)` walks each pid and its descendants and sums user + system CPU seconds
per role: a Baton worker's main thread is its event loop, the thread named
`baton-engine` (`AsyncEngine` names it) its engine loop (torch's threads it started inherit
its name: the first of them), its other threads torch's compute pool; a router or a `baton up` supervisor counts whole. CPU time, unlike wall-clock rates,
is what a process spent whatever else the machine is doing.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
ENGINE_THREAD = "baton-engine"


def _stat(path: Path) -> list[str] | None:
    try:
        raw = path.read_text()
    except OSError:  # the thread or process ended
        return None
    # comm may hold spaces and parentheses: the fields after it follow the last ')'
    return raw[raw.rindex(")") + 2:].split()


def _cpu(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _comm(task: Path) -> str:
    try:
        return (task / "comm").read_text().strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry / "stat")) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _process_role(pid: int) -> str:
    cmd = _cmdline(pid)
    if " router" in cmd:
        return "router"
    if " up " in cmd or cmd.endswith(" up"):
        return "baton up supervisor"
    return "worker"


def cpu_by_role(pids: list[int], main_role: str = "worker event loop") -> dict[str, float]:
    """CPU seconds so far per role over `pids` and their descendants. In a worker (or the
    calling process, naming its main thread `main_role`): the main thread, the engine
    thread, the rest ("compute threads")."""
    out: dict[str, float] = {}
    for root in pids:
        for pid in descendants(root):
            role = _process_role(pid)
            task_dir = Path(f"/proc/{pid}/task")
            try:
                tids = [int(t) for t in os.listdir(task_dir)]
            except OSError:
                continue
            # torch's compute threads inherit the name of the thread that started them: the
            # engine thread is the first (lowest tid) of those named after it.
            named = [t for t in tids if _comm(task_dir / str(t)) == ENGINE_THREAD]
            engine = min(named) if named else None
            for tid in tids:
                fields = _stat(task_dir / str(tid) / "stat")
                if fields is None:
                    continue
                name = role
                if role == "worker":
                    name = (main_role if tid == pid else "engine thread" if tid == engine
                            else "compute threads")
                out[name] = out.get(name, 0.0) + _cpu(fields)
    return out
