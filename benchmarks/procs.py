"""Loopback ports, readiness waits, log tails and streamed (SSE) responses' events for the
benchmarks and scenarios that start servers."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """A base port with n free consecutive ports from it."""
    for _ in range(100):
        base = free_port()
        if base + n < 65535 and all(_free(p) for p in range(base, base + n)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, probe: str = "/ready"
               ) -> None:
    """Until `url` + `probe` answers 200 (another server's probe: llama-server's `/health`);
    fails at once if the process exits."""
    from baton.launch import http_status

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if http_status(url + probe) == 200:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def tail(path: Path, chars: int = 3000) -> str:
    """The end of a log file ("" when there is none)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Each `data:` event of a streamed response, parsed, as its line arrives (the
    `[DONE]` sentinel and other lines skipped)."""
    async for line in resp.content:
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        yield json.loads(line[5:])
