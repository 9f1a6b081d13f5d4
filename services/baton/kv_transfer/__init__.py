"""KV block transfer between engines (DESIGN.md §5): the contract in `base.py`, transports
`local` (in-process), `tcp` (no dependency) and `gloo` / `nccl` (torch.distributed pair
groups), chosen by name with `make_transport`."""

from __future__ import annotations

TRANSPORTS = ("local", "tcp", "gloo")


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
    raise ValueError(f"unknown KV transport {name!r}; known: {TRANSPORTS}")
