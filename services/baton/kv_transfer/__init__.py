"""KV block transfer between engines (docs/design.md §5): the contract in `base.py`; `local`
(in-process) and the network transports, one control plane (`network.py`) with a data
plane each (`dataplane.py`): `tcp` (no dependency: a host cache in place, `iov.py`, any
other staged through host memory, `staging.py`), `gloo` / `nccl` (a torch.distributed
group per peer pair, reused) and `nixl` (UCX one-sided reads of DRAM or VRAM), chosen by
name with `make_transport`. None of them views a device cache from the host.

`TRANSPORTS` is the one registry of transport names: the CLI's choices, the engine config's
check and the conformance suite all read it."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing the package loads neither torch nor a transport
    from baton.kv_transfer.base import KVTransport


@dataclass(frozen=True)
class TransportSpec:
    """A network transport's data plane maker (`network` True: the control plane of
    `network.py` around it), or an in-process transport's class; imported on first use."""

    module: str
    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)  # fixed constructor arguments
    network: bool = True


TRANSPORTS: dict[str, TransportSpec] = {
    "local": TransportSpec("baton.kv_transfer.local", "LocalTransport", network=False),
    "tcp": TransportSpec("baton.kv_transfer.tcp", "TcpPlanes"),
    "gloo": TransportSpec("baton.kv_transfer.gloo", "GlooPlanes", {"backend": "gloo"}),
    "nccl": TransportSpec("baton.kv_transfer.gloo", "GlooPlanes", {"backend": "nccl"}),
    "nixl": TransportSpec("baton.kv_transfer.nixl", "NixlPlanes"),
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


def make_transport(name: str, **kwargs: Any) -> KVTransport:
    """The transport `name`. A network transport takes the control plane's options
    (`network.ControlOptions`: host, port, secret, limits, TP heads) and its data plane's
    (tcp: `stage_via_host`, `staging_bytes`); TypeError for others, ValueError for bad
    values, RuntimeError when nixl's package is missing."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}")
    spec = TRANSPORTS[name]
    cls = getattr(importlib.import_module(spec.module), spec.cls)
    if not spec.network:
        transport: KVTransport = cls(**spec.kwargs, **kwargs)
        return transport
    from baton.kv_transfer.network import ControlOptions, NetworkTransport

    control = {f.name for f in dataclasses.fields(ControlOptions)}
    options = ControlOptions(**{k: v for k, v in kwargs.items() if k in control})
    planes = cls(options.host, **spec.kwargs,
                 **{k: v for k, v in kwargs.items() if k not in control})
    return NetworkTransport(name, planes, options)
