"""In-process transport: holders register in a process-wide table; a pull copies on a
worker thread. For unit tests and single-process setups. The network transports' rules hold
here too: a puller's secret must match the holder's, and a lease is bound to the first
puller (by engine id) that claims it."""

from __future__ import annotations

import hmac
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer.base import (
    KVAuthError,
    KVTransport,
    LayoutMismatchError,
    PeerUnreachableError,
    Transfer,
    TransferError,
    check_pull,
    gather_blocks,
    scatter_blocks,
)
from baton.kv_transfer.leases import LeaseTable

_HOLDERS: dict[str, "LocalTransport"] = {}
_LOCK = threading.Lock()


def _same_secret(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a.encode(), b.encode())


class LocalTransport(KVTransport):
    name = "local"

    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret
        self.kv_cache: torch.Tensor | None = None
        self.layout: KVLayoutInfo | None = None
        self.endpoint: KVEndpointInfo | None = None
        self.leases = LeaseTable()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-local")

    def start(self, kv_cache: torch.Tensor, engine_id: str) -> KVEndpointInfo:
        self.kv_cache, self.layout = kv_cache, KVLayoutInfo.of(kv_cache)
        self.leases.num_blocks = kv_cache.shape[2]
        self.endpoint = KVEndpointInfo(self.name, engine_id, engine_id, self.layout)
        with _LOCK:
            _HOLDERS[engine_id] = self
        return self.endpoint

    def connect(self, peer: KVEndpointInfo) -> None:
        if peer.layout != self.layout:  # no head subsets here: the same shard or none
            raise LayoutMismatchError(f"peer {peer.engine_id} has layout {peer.layout}, "
                                      f"ours is {self.layout}")
        with _LOCK:
            holder = _HOLDERS.get(peer.address)
        if holder is None:
            raise PeerUnreachableError(f"no local engine {peer.address!r}")
        if not _same_secret(holder.secret, self.secret):
            raise KVAuthError(f"local engine {peer.address!r} and this one have different "
                              "KV secrets (or only one has one)")

    def _started(self) -> tuple[torch.Tensor, KVLayoutInfo, KVEndpointInfo]:
        if self.kv_cache is None or self.layout is None or self.endpoint is None:
            raise RuntimeError("the local transport serves and pulls once start() has run")
        return self.kv_cache, self.layout, self.endpoint

    def pull(self, peer: KVEndpointInfo, lease_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], timeout_s: float) -> Transfer:
        kv_cache, layout, _ = self._started()
        check_pull(layout, src_block_ids, dst_block_ids, kv_cache.shape[2])
        transfer = Transfer(lease_id, len(dst_block_ids))
        self._pool.submit(self._copy, transfer, peer, lease_id, list(src_block_ids),
                          list(dst_block_ids))
        return transfer

    def _copy(self, transfer: Transfer, peer: KVEndpointInfo, lease_id: str, src: list[int],
              dst: list[int]) -> None:
        try:
            self.connect(peer)
            with _LOCK:
                holder = _HOLDERS[peer.address]
            kv_cache, _, me = self._started()
            transfer._transferring()
            holder.leases.take(lease_id, src, me.engine_id)
            try:
                data = gather_blocks(holder._started()[0], src) if src else None
            except BaseException:
                holder.leases.abandon(lease_id)
                raise
            holder.leases.complete(lease_id)
            if data is not None:
                scatter_blocks(kv_cache, dst, data)
            transfer._succeed(0 if data is None else data.numel() * data.element_size())
        except TransferError as err:
            transfer._fail(err)
        except Exception as err:  # noqa: BLE001 - any failure is the transfer's
            transfer._fail(TransferError(f"local copy failed: {err!r}"))

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float) -> str:
        return self.leases.hold(request_id, block_ids, ttl_s)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def released(self) -> list[tuple[str, str]]:
        return self.leases.released()

    def close(self) -> None:
        with _LOCK:
            if self.endpoint is not None and _HOLDERS.get(self.endpoint.address) is self:
                del _HOLDERS[self.endpoint.address]
        self.leases.release_all()
        self._pool.shutdown(wait=True)
