"""torch.distributed point-to-point transport: `gloo` on CPU caches, `nccl` on CUDA ones.

The control plane is the tcp transport's (bounded frames, the handshake with the layout
fingerprint and the secret's challenge, pull, ack, leases); only the data phase differs:
for each pull the holder opens a `TCPStore` on a free port and says which in its reply,
both sides build a two-rank process group on it (the holder rank 0, the puller rank 1; no
torchrun, ~10 ms), the holder gathers the blocks into one contiguous tensor and `send`s
it, the puller `recv`s it into a staging tensor and scatters it into its destination
blocks. One large message, because many small sends are slow on gloo. (The store itself
takes no secret: its port, random and open for one pull, is told only to the puller that
passed the handshake.)
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from baton.kv_transfer.base import (Endpoint, PeerUnreachableError, TransferTimeoutError,
                                    gather_blocks, scatter_blocks, wire_view)
from baton.kv_transfer.tcp import TcpTransport
from baton.kv_transfer.wire import send_msg

_SETUP = timedelta(seconds=30)


def _group(store, rank: int, timeout: timedelta, backend: str):
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class GlooTransport(TcpTransport):
    name = "gloo"
    head_subsets = False

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_pulls: int = 8,
                 backend: str = "gloo", **control) -> None:
        super().__init__(host, port, max_pulls, **control)  # control: tcp's secret, limits
        self.backend = backend
        self.name = backend

    def start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        if self.backend == "gloo" and kv_cache.device.type != "cpu":
            raise ValueError("the gloo transport moves host memory; use nccl for GPU caches")
        return self._start(kv_cache, engine_id)

    def _send_blocks(self, conn: socket.socket, blocks: list[int]) -> None:
        if not blocks:
            send_msg(conn, {"ok": True, "nbytes": 0})
            return
        data = gather_blocks(self.kv_cache, blocks).contiguous()
        store = dist.TCPStore(self.host, 0, 2, True, timeout=_SETUP, wait_for_workers=False)
        send_msg(conn, {"ok": True, "nbytes": data.numel() * data.element_size(),
                         "store_port": store.port})
        pg = _group(store, 0, _SETUP, self.backend)
        pg.send([data], 1, 0).wait(_SETUP)

    def _receive(self, sock: socket.socket, reply: dict, src: list[int], dst: list[int],
                 remaining, peer: Endpoint) -> int:
        n = len(src)
        if n == 0:
            return 0
        lay = self.layout
        staging = wire_view(torch.empty((lay.num_layers, 2, n, lay.block_size,
                                         lay.num_kv_heads, lay.head_dim),
                                        dtype=self.kv_cache.dtype, device=self.kv_cache.device))
        host = peer.address.rsplit(":", 1)[0]
        try:
            left = timedelta(seconds=remaining())
            port = reply.get("store_port")
            if type(port) is not int or not 0 < port < 65536:
                raise PeerUnreachableError(f"{peer.address} named no store port: {port!r}")
            store = dist.TCPStore(host, port, 2, False, timeout=left)
            pg = _group(store, 1, left, self.backend)
            if not pg.recv([staging], 0, 0).wait(timedelta(seconds=remaining())):
                raise TransferTimeoutError(f"receiving from {peer.address} timed out")
        except RuntimeError as err:  # gloo's errors: tell a timeout from a lost peer
            text = str(err).lower()
            if "timed out" in text or "timeout" in text:
                raise TransferTimeoutError(f"receiving from {peer.address} timed out: "
                                           f"{err}") from None
            raise PeerUnreachableError(f"lost {peer.address} during the transfer: {err}") \
                from None
        scatter_blocks(self.kv_cache, dst, staging)
        return staging.numel() * staging.element_size()
