"""Small builders shared by the KV transfer tests."""

from __future__ import annotations

import os
import socket
import time

import torch

SECRET = "kv-secret-for-tests-0001"
OTHER_SECRET = "kv-secret-for-tests-0002"


def cache(layers=4, blocks=16, bs=4, kvh=2, d=8, dtype=torch.float32, fill=True):
    if fill:
        return torch.randn(layers, 2, blocks, bs, kvh, d).to(dtype)
    return torch.zeros(layers, 2, blocks, bs, kvh, d, dtype=dtype)


def rss_bytes() -> int:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed `sock` (EOF or reset), reading and dropping whatever
    it sends; None if it is still open after `seconds`."""
    t0 = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - t0 < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None
