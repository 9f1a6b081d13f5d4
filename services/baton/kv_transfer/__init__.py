"""KV block transfer between engines (docs/design.md §5): the contract in `base.py`, transports
`local` (in-process), `tcp` (no dependency; a GPU cache staged through host memory), `gloo` /
`nccl` (a torch.distributed group per peer pair, reused) and `nixl` (UCX one-sided reads of
DRAM or VRAM), chosen by name with `make_transport`. None of them views a device cache
from the host.

`TRANSPORTS` is the one registry of transport names: the CLI's choices, the engine config's
check and the conformance suite all read it."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransportSpec:
    module: str                 # where its class lives (imported on first use)
    cls: str
    kwargs: dict = field(default_factory=dict)  # fixed constructor arguments


TRANSPORTS: dict[str, TransportSpec] = {
    "local": TransportSpec("baton.kv_transfer.local", "LocalTransport"),
    "tcp": TransportSpec("baton.kv_transfer.tcp", "TcpTransport"),
    "gloo": TransportSpec("baton.kv_transfer.gloo", "GlooTransport", {"backend": "gloo"}),
    "nccl": TransportSpec("baton.kv_transfer.gloo", "GlooTransport", {"backend": "nccl"}),
    "nixl": TransportSpec("baton.kv_transfer.nixl", "NixlTransport"),
}
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


def unavailable(name: str) -> str | None:
    """Why this machine cannot run transport `name`, or None when it can."""
    if name not in TRANSPORTS:
        return f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}"
    if name == "nixl" and not any(importlib.util.find_spec(m) for m in NIXL_MODULES):
        return "the nixl transport's package (nixl-cu12 / nixl-cu13) is not installed"
    if name == "nccl":
        import torch

        if not torch.cuda.is_available():
            return "nccl moves CUDA caches: no CUDA device here"
    return None


def installed_transports() -> tuple[str, ...]:
    """The transports this machine can run (`nixl` needs its optional package, `nccl` CUDA)."""
    return tuple(name for name in TRANSPORTS if unavailable(name) is None)


def best_transport() -> str:
    """What `--kv-transport auto` means: NIXL when installed, else the dependency-free tcp."""
    return "nixl" if unavailable("nixl") is None else "tcp"


def make_transport(name: str, **kwargs):
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}")
    spec = TRANSPORTS[name]
    cls = getattr(importlib.import_module(spec.module), spec.cls)
    return cls(**spec.kwargs, **kwargs)
