"""Scatter/gather socket I/O for the tcp data phase: the wire-order views of a host cache's
blocks (no copy: runs of consecutive ids become one buffer), and `sendmsg` /
`recvmsg_into` over lists of buffers. Only a cache in host memory has such views; a device
cache goes through `staging.py`, whose host buffer these helpers also move."""

from __future__ import annotations

import socket

import torch

from baton.kv_transfer.base import PeerUnreachableError

_IOV_MAX = 1024


def host_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes, shared with it (ValueError for any other device: there is no
    host memory to view)."""
    if t.device.type != "cpu":
        raise ValueError(f"no host view of a {t.device.type} tensor")
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive ids, in order."""
    out: list[list[int]] = []
    for b in ids:
        if out and b == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return [(s, n) for s, n in out]


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


def recv_views(sock: socket.socket, views: list[memoryview], remaining, peer_address: str
                ) -> int:
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
