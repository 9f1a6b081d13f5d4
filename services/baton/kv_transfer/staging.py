"""Host staging for the tcp data phase of a cache that is not in host memory (a GPU's).

The bytes on the wire are the same as the zero-copy path's (layer, K/V, block, token, the
pull's heads), cut into chunks that fit a bounded host buffer — pinned when the cache is
on CUDA, plain host memory otherwise (torch refuses to pin without CUDA). A chunk is a
stretch of (layer, K/V, block) units in wire order; each side chunks on its own, so a
staged holder feeds a zero-copy puller and the other way round.

Holder: per chunk, one `copy_` device -> buffer per run of consecutive block ids (all of a
block's heads, or the pull's head range: a strided copy), then a wait on that copy alone
(an event on the buffer's own CUDA stream, not a device synchronize), then `sendmsg`.
Puller: per chunk, `recvmsg_into` the buffer, then one `copy_` buffer -> device per run of
destination ids, and a wait on those copies before the buffer is reused. Nothing here takes
a host view of the cache: only the staging buffer's own bytes are viewed.

Buffers are made lazily, at most `max_buffers` per transport, and reused; a transfer
waits (up to its deadline) for a free one.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from baton.kv_transfer.base import TransferTimeoutError
from baton.kv_transfer.iov import host_bytes, recv_views, runs, send_views

STAGING_BYTES = 32 << 20  # per buffer: a few MiB keep both sides streaming


class StagingCopyError(RuntimeError):
    """The device refused a copy to or from the staging buffer; `began`: whether the data
    had started to flow (after the header)."""

    def __init__(self, why: str, began: bool) -> None:
        super().__init__(why)
        self.began = began


def unit_bytes(kv_cache: torch.Tensor, heads: tuple[int, int]) -> int:
    """One (layer, K/V, block) unit of the wire: a block's tokens x the heads [lo, hi)."""
    _, _, _, bs, _, d = kv_cache.shape
    return bs * (heads[1] - heads[0]) * d * kv_cache.element_size()


def wire_bytes(kv_cache: torch.Tensor, n: int, heads: tuple[int, int]) -> int:
    """A pull of `n` blocks' heads [lo, hi): what travels, staged or not."""
    return kv_cache.shape[0] * 2 * n * unit_bytes(kv_cache, heads)


def side_stream(device: torch.device):
    """CUDA: a stream of its own, so a transfer is not serialised behind the engine's
    steps (None elsewhere)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


@contextmanager
def on_stream(stream):
    """Run on `stream` (None: as we are), after whatever this thread's stream has queued
    (the engine wrote the held blocks, or allocated the pulled ones, before that)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def wait_for(stream) -> None:
    """Until the work queued on `stream` is done: an event on it, not a device sync."""
    if stream is not None:
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()


class Staging:
    """One host buffer and the copies between it and the cache; used by one transfer at a
    time (its pool hands it out)."""

    def __init__(self, kv_cache: torch.Tensor, nbytes: int) -> None:
        self.kv = kv_cache.view(torch.uint8)  # [layers, 2, blocks, bs, heads, head_dim*elt]
        self.cuda = kv_cache.device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.mem = host_bytes(self.host)  # the buffer's bytes (never the cache's)
        self.stream = side_stream(kv_cache.device)

    def chunks(self, n: int, heads: tuple[int, int]) -> Iterator[tuple[int, int, int]]:
        """(a, b, bytes): ranges [a, b) of the 2 x layers x n units, each fitting the
        buffer."""
        unit = unit_bytes(self.kv, heads)
        per = max(1, len(self.mem) // unit)
        total = self.kv.shape[0] * 2 * n
        for a in range(0, total, per):
            b = min(a + per, total)
            yield a, b, (b - a) * unit

    def _pieces(self, ids: list[int], heads: tuple[int, int], a: int, b: int
                ) -> Iterator[tuple[torch.Tensor, int]]:
        """The cache views of units [a, b) (one per run of consecutive ids within a
        layer's K or V) and where each starts in the buffer."""
        n, lo, hi, pos = len(ids), heads[0], heads[1], 0
        for lk in range(a // n, (b - 1) // n + 1):
            i0, i1 = max(a - lk * n, 0), min(b - lk * n, n)
            for start, length in runs(ids[i0:i1]):
                view = self.kv[lk // 2, lk % 2, start:start + length, :, lo:hi]
                yield view, pos  # (length, bs, heads, head_dim*elt), strided for a subset
                pos += view.numel()

    def gather(self, ids: list[int], heads: tuple[int, int], a: int, b: int) -> memoryview:
        """Units [a, b) of the blocks `ids` into the buffer; its filled bytes."""
        end = 0
        with on_stream(self.stream):
            for view, pos in self._pieces(ids, heads, a, b):
                end = pos + view.numel()
                self.host[pos:end].view(view.shape).copy_(view, non_blocking=self.cuda)
            wait_for(self.stream)
        return self.mem[:end]

    def scatter(self, ids: list[int], heads: tuple[int, int], a: int, b: int) -> None:
        """The buffer's bytes into units [a, b) of the blocks `ids`."""
        with on_stream(self.stream):
            for view, pos in self._pieces(ids, heads, a, b):
                view.copy_(self.host[pos:pos + view.numel()].view(view.shape),
                           non_blocking=self.cuda)
            wait_for(self.stream)


class StagingPool:
    """At most `max_buffers` Staging buffers for one cache, made when first needed."""

    def __init__(self, kv_cache: torch.Tensor, nbytes: int = STAGING_BYTES,
                 max_buffers: int = 4) -> None:
        if nbytes < 1 or max_buffers < 1:
            raise ValueError(f"staging_bytes={nbytes} and max_buffers={max_buffers} must "
                             "be >= 1")
        self.kv_cache = kv_cache
        whole = kv_cache[0, 0, 0].numel() * kv_cache.element_size()  # one unit, all heads
        self.nbytes = max(nbytes, whole)
        self._free: list[Staging] = []
        self._made = 0
        self._slots = threading.BoundedSemaphore(max_buffers)
        self._lock = threading.Lock()

    @property
    def made(self) -> int:
        return self._made

    def take(self, timeout_s: float) -> Staging:
        """A free buffer, for one transfer until it is `give`n back; TransferTimeoutError
        when none frees up in `timeout_s`."""
        if not self._slots.acquire(timeout=max(timeout_s, 0.0)):
            raise TransferTimeoutError(f"no free KV staging buffer within {timeout_s:.1f} s")
        try:
            with self._lock:
                if self._free:
                    return self._free.pop()
            buf = Staging(self.kv_cache, self.nbytes)
            with self._lock:
                self._made += 1
            return buf
        except BaseException:
            self._slots.release()
            raise

    def give(self, buf: Staging) -> None:
        with self._lock:
            self._free.append(buf)
        self._slots.release()

    def send(self, sock: socket.socket, ids: list[int], heads: tuple[int, int],
             timeout_s: float, header: Callable[[], None]) -> None:
        """The blocks `ids` (local heads [lo, hi)) on `sock`, chunk by chunk; `header()`
        once the first chunk is in the buffer. Raises TransferTimeoutError when no buffer
        frees up in `timeout_s`, StagingCopyError when the device refuses a copy, OSError
        when the socket does."""
        buf = self.take(timeout_s)
        began = False
        try:
            for a, b, _ in buf.chunks(len(ids), heads) if ids else ():
                try:
                    data = buf.gather(ids, heads, a, b)
                except Exception as err:  # noqa: BLE001 - the device's own error types
                    raise StagingCopyError(repr(err), began) from None
                if not began:
                    header()
                    began = True
                send_views(sock, [data])
            if not began:
                header()
        finally:
            self.give(buf)

    def receive(self, sock: socket.socket, ids: list[int], heads: tuple[int, int],
                remaining: Callable[[], float], address: str) -> int:
        """The bytes of blocks `ids` (local heads [lo, hi)) from `sock` into the cache, chunk
        by chunk; the bytes taken. TransferTimeoutError past the deadline `remaining()`
        tells, PeerUnreachableError when the holder hangs up."""
        buf = self.take(remaining())
        try:
            got = 0
            for a, b, nbytes in buf.chunks(len(ids), heads):
                got += recv_views(sock, [buf.mem[:nbytes]], remaining, address)
                buf.scatter(ids, heads, a, b)
            return got
        finally:
            self.give(buf)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
