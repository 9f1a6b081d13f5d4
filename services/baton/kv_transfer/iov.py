"""The tcp transport's data plane for a host cache: the blocks' bytes over the control
socket, read and written in place — the wire-order views of the cache's blocks (no copy:
runs of consecutive ids become one buffer), `sendmsg` / `recvmsg_into` over lists of
buffers. Only a cache in host memory has such views; a device cache goes through
`staging.py`, whose host buffer these helpers also move.

On the wire, after the pull's header `{"ok": true, "nbytes": n}`: the blocks in wire order
(layer, K/V, block, token, the pull's heads); both sides know `n` from the block ids and
the heads, and the puller refuses a header that says otherwise."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer.base import PeerUnreachableError, TransferError
from baton.kv_transfer.dataplane import Incoming, Outgoing, Remaining
from baton.kv_transfer.wire import send_msg

_IOV_MAX = 1024


def host_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes, shared with it (ValueError for any other device: there is no
    host memory to view)."""
    if t.device.type != "cpu":
        raise ValueError(f"no host view of a {t.device.type} tensor")
    return t.view(-1).view(torch.uint8).numpy().data.cast("B")


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive ids, in order."""
    out: list[list[int]] = []
    for b in ids:
        if out and b == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return [(s, n) for s, n in out]


def unit_bytes(kv_cache: torch.Tensor, heads: tuple[int, int]) -> int:
    """One (layer, K/V, block) unit of the wire: a block's tokens x the heads [lo, hi)."""
    _, _, _, bs, _, d = kv_cache.shape
    return int(bs * (heads[1] - heads[0]) * d * kv_cache.element_size())


def wire_bytes(kv_cache: torch.Tensor, n: int, heads: tuple[int, int]) -> int:
    """A pull of `n` blocks' heads [lo, hi): what travels, staged or not."""
    return int(kv_cache.shape[0]) * 2 * n * unit_bytes(kv_cache, heads)


def expected(kv_cache: torch.Tensor, layout: KVLayoutInfo, pull: Incoming
             ) -> tuple[tuple[int, int], int]:
    """Puller: the pull's heads as our local [lo, hi) and the bytes the holder must send;
    TransferError when its header says another size."""
    lo = layout.head_start
    local = (pull.heads[0] - lo, pull.heads[1] - lo)
    want = wire_bytes(kv_cache, len(pull.dst), local)
    if pull.reply.get("nbytes") != want:
        raise TransferError(f"holder sent {pull.reply.get('nbytes')} bytes, expected {want}")
    return local, want


class IovPlane:
    """tcp over a host cache: the blocks' own memory on the control socket, no copy."""

    head_subsets = True

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayoutInfo) -> None:
        self.kv_cache, self.layout = kv_cache, layout
        self.cache_bytes = host_bytes(kv_cache)  # the cache's own bytes (zero-copy)

    def hello(self) -> dict[str, Any]:
        return {"ok": True}

    def greeted(self, peer: KVEndpointInfo, reply: dict[str, Any]) -> None:
        """Nothing to learn from a tcp holder's hello."""

    def session(self, peer: KVEndpointInfo, remaining: Remaining
                ) -> contextlib.nullcontext[dict[str, Any]]:
        return contextlib.nullcontext({})

    def send(self, out: Outgoing) -> None:
        views = block_views(self.kv_cache, self.cache_bytes, out.blocks, out.heads)
        send_msg(out.conn, {"ok": True, "nbytes": sum(len(v) for v in views)})
        send_views(out.conn, views)

    def receive(self, pull: Incoming) -> int:
        """Straight into those heads of our `dst` blocks (no staging copy)."""
        local, want = expected(self.kv_cache, self.layout, pull)
        if not want:
            return 0
        views = block_views(self.kv_cache, self.cache_bytes, pull.dst, local)
        return recv_views(pull.sock, views, pull.remaining, pull.peer.address)

    def close(self) -> None:
        """Nothing held beyond the cache's own memory."""


def block_views(kv_cache: torch.Tensor, cache_bytes: memoryview, block_ids: list[int],
                heads: tuple[int, int] | None = None) -> list[memoryview]:
    """The blocks' memory in wire order (layer, K/V, then the blocks in the given order), as
    views into the cache itself: runs of consecutive ids become one view each. `heads`:
    only these local KV heads [lo, hi) (tensor parallelism across TP degrees), one view
    per (layer, K/V, block, token) — still no copy."""
    layers2, nb = kv_cache.shape[0] * 2, kv_cache.shape[2]
    if heads is not None and tuple(heads) != (0, kv_cache.shape[4]):
        return _head_views(kv_cache, cache_bytes, block_ids, heads)
    seg = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    spans, views = runs(block_ids), []
    for lk in range(layers2):
        base = lk * nb
        for start, length in spans:
            off = (base + start) * seg
            views.append(cache_bytes[off:off + length * seg])
    return views


def _head_views(kv_cache: torch.Tensor, cache_bytes: memoryview, block_ids: list[int],
                heads: tuple[int, int]) -> list[memoryview]:
    """Wire order (layer, K/V, block, token, then the heads [lo, hi) of that token)."""
    layers2, nb, bs, kvh, d = (kv_cache.shape[0] * 2, kv_cache.shape[2], kv_cache.shape[3],
                               kv_cache.shape[4], kv_cache.shape[5])
    elt = kv_cache.element_size()
    tok, lo, hi = kvh * d * elt, heads[0] * d * elt, heads[1] * d * elt
    views = []
    for lk in range(layers2):
        for b in block_ids:
            base = (lk * nb + b) * bs * tok
            for t in range(bs):
                off = base + t * tok
                views.append(cache_bytes[off + lo:off + hi])
    return views


def send_views(sock: socket.socket, views: list[memoryview]) -> int:
    """sendmsg scatter/gather straight from the cache, IOV_MAX buffers a call."""
    total = 0
    i = 0
    while i < len(views):
        batch = views[i:i + _IOV_MAX]
        sent = sock.sendmsg(batch)
        total += sent
        while batch and sent >= len(batch[0]):  # drop the fully sent buffers
            sent -= len(batch[0])
            batch.pop(0)
            i += 1
        if batch and sent:
            views[i] = batch[0][sent:]
    return total


def recv_views(sock: socket.socket, views: list[memoryview], remaining: Remaining,
               peer_address: str) -> int:
    """recvmsg_into straight into the cache's destination blocks."""
    total = 0
    i = 0
    want = sum(len(v) for v in views)
    while i < len(views):
        sock.settimeout(remaining())
        got = sock.recvmsg_into(views[i:i + _IOV_MAX])[0]
        if got == 0:
            raise PeerUnreachableError(f"{peer_address} closed the connection after {total} "
                                       f"of {want} bytes")
        total += got
        while i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]
    return total
