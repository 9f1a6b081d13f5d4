"""KV block transfer between engines (docs/design.md §5): the contract in `base.py`, transports
`local` (in-process), `tcp` (no dependency; a GPU cache staged through host memory), `gloo` /
`nccl` (a torch.distributed group per peer pair, reused) and `nixl` (UCX one-sided reads of
DRAM or VRAM), chosen by name with `make_transport`. None of them views a device cache
from the host."""

from __future__ import annotations

import importlib.util

TRANSPORTS = ("local", "tcp", "gloo", "nixl")


def installed_transports() -> tuple[str, ...]:
    """The transports this machine can run (`nixl` needs its optional package)."""
    has_nixl = any(importlib.util.find_spec(m) is not None
                   for m in ("nixl_cu12", "nixl_cu13", "nixl"))
    return tuple(t for t in TRANSPORTS if t != "nixl" or has_nixl)


def best_transport() -> str:
    """What `--kv-transport auto` means: NIXL when installed, else the dependency-free tcp."""
    return "nixl" if "nixl" in installed_transports() else "tcp"


def make_transport(name: str, **kwargs):
    if name == "local":
        from baton.kv_transfer.local import LocalTransport

        return LocalTransport(**kwargs)
    if name == "tcp":
        from baton.kv_transfer.tcp import TcpTransport

        return TcpTransport(**kwargs)
    if name in ("gloo", "nccl"):
        from baton.kv_transfer.gloo import GlooTransport

        return GlooTransport(backend=name, **kwargs)
    if name == "nixl":
        from baton.kv_transfer.nixl import NixlTransport

        return NixlTransport(**kwargs)
    raise ValueError(f"unknown KV transport {name!r}; known: {TRANSPORTS}")
