"""The tcp transport's data planes: no dependency beyond the standard library, any device's
cache, one wire. Which plane depends on where this side's cache lives, never on the peer:
a host cache is read and written in place with scatter/gather I/O (`iov.py`); any other
cache (CUDA) goes through a bounded host staging buffer, chunk by chunk (`staging.py`;
pinned on CUDA), which `stage_via_host=True` forces on a host cache too (tests use it).
Either plane moves a subset of the KV heads across tensor-parallel degrees.
"""

from __future__ import annotations

import torch

from baton.common.internal import KVLayoutInfo
from baton.kv_transfer.dataplane import DataPlane
from baton.kv_transfer.iov import IovPlane
from baton.kv_transfer.staging import STAGING_BYTES, StagedPlane, StagingPool


class TcpPlanes:
    """`stage_via_host`: move the bytes through a bounded host buffer of `staging_bytes`
    (None: when the cache is not in host memory; True forces it on a host cache too)."""

    def __init__(self, host: str, stage_via_host: bool | None = None,
                 staging_bytes: int = STAGING_BYTES) -> None:
        self.stage_via_host, self.staging_bytes = stage_via_host, staging_bytes

    def open(self, kv_cache: torch.Tensor, layout: KVLayoutInfo, engine_id: str) -> DataPlane:
        on_host = kv_cache.device.type == "cpu"
        if self.stage_via_host is False and not on_host:
            raise ValueError(f"a {kv_cache.device.type} KV cache has no host memory to send "
                             "from: tcp must stage it (stage_via_host None or True)")
        if self.stage_via_host or not on_host:
            pool = StagingPool(kv_cache, self.staging_bytes)
            return StagedPlane(kv_cache, layout, pool, engine_id)
        return IovPlane(kv_cache, layout)
