"""The tcp transport's data plane for a cache that is not in host memory (a GPU's): host
staging (`StagedPlane`; `stage_via_host=True` forces it on a host cache too).

The bytes on the wire are the same as the zero-copy path's (layer, K/V, block, token, the
pull's heads), cut into chunks that fit a bounded host buffer — pinned when the cache is
on CUDA, plain host memory otherwise (torch refuses to pin without CUDA). A chunk is a
stretch of (layer, K/V, block) units in wire order; each side chunks on its own, so a
staged holder feeds a zero-copy puller and the other way round.

Holder: per chunk and per layer's K or V, one `index_select` of the blocks on the device
(all of a block's heads, or the pull's head range) and one copy into the buffer, then a
wait on those copies alone (an event on the buffer's own CUDA stream, not a device
synchronize), then `sendmsg`. Puller: per chunk, `recvmsg_into` the buffer, then per
layer's K or V one copy to the device and one `index_copy_` into the destination blocks,
and a wait on those before the buffer is reused. (A copy per run of consecutive blocks
took 3x as long for 256 shuffled blocks: thousands of small copies a pull.) Nothing here takes
a host view of the cache: only the staging buffer's own bytes are viewed.

Buffers are made lazily, at most `max_buffers` per transport, and reused; a transfer
waits (up to its deadline) for a free one.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer.base import TransferError, TransferTimeoutError
from baton.kv_transfer.dataplane import (
    DATA_TIMEOUT_S,
    DataUnavailable,
    Incoming,
    Outgoing,
    Remaining,
)
from baton.kv_transfer.iov import (
    expected,
    host_bytes,
    recv_views,
    send_views,
    unit_bytes,
    wire_bytes,
)
from baton.kv_transfer.wire import send_msg

log = logging.getLogger(__name__)

STAGING_BYTES = 32 << 20  # per buffer: a few MiB keep both sides streaming


class StagingCopyError(RuntimeError):
    """The device refused a copy to or from the staging buffer; `began`: whether the data
    had started to flow (after the header)."""

    def __init__(self, why: str, began: bool) -> None:
        super().__init__(why)
        self.began = began


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """CUDA: a stream of its own, so a transfer is not serialised behind the engine's
    steps (None elsewhere)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: untyped


@contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run on `stream` (None: as we are), after whatever this thread's stream has queued
    (the engine wrote the held blocks, or allocated the pulled ones, before that)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


def wait_for(stream: torch.cuda.Stream | None) -> None:
    """Until the work queued on `stream` is done: an event on it, not a device sync."""
    if stream is not None:
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: untyped
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

    def _segments(self, n: int, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """(layer * 2 + K/V, i0, i1): units [a, b) of an n-block pull, as the blocks
        ids[i0:i1] of one layer's K or V each, in wire order."""
        for lk in range(a // n, (b - 1) // n + 1):
            yield lk, max(a - lk * n, 0), min(b - lk * n, n)

    def gather(self, ids: list[int], heads: tuple[int, int], a: int, b: int) -> memoryview:
        """Units [a, b) of the blocks `ids` into the buffer; its filled bytes. One
        `index_select` on the device and one copy to the buffer per layer's K or V."""
        lo, hi = heads
        end = 0
        with on_stream(self.stream):
            idx = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
            for lk, i0, i1 in self._segments(len(ids), a, b):
                part = self.kv[lk // 2, lk % 2, :, :, lo:hi].index_select(0, idx[i0:i1])
                n = part.numel()  # (i1 - i0, bs, heads, head_dim * elt), wire order
                self.host[end:end + n].view(part.shape).copy_(part, non_blocking=self.cuda)
                end += n
            wait_for(self.stream)
        return self.mem[:end]

    def scatter(self, ids: list[int], heads: tuple[int, int], a: int, b: int) -> None:
        """The buffer's bytes into units [a, b) of the blocks `ids`: per layer's K or V one
        copy to the device and one `index_copy_`."""
        lo, hi = heads
        pos = 0
        with on_stream(self.stream):
            idx = torch.tensor(ids, dtype=torch.long, device=self.kv.device)
            for lk, i0, i1 in self._segments(len(ids), a, b):
                dst = self.kv[lk // 2, lk % 2, :, :, lo:hi]
                shape = (i1 - i0, *dst.shape[1:])
                n = shape[0] * dst[0].numel()
                part = self.host[pos:pos + n].view(shape)
                if part.device != dst.device:
                    part = part.to(dst.device, non_blocking=self.cuda)
                dst.index_copy_(0, idx[i0:i1], part)
                pos += n
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


class StagedPlane:
    """tcp over a cache without host memory (or forced): the same wire as `IovPlane`'s,
    through the staging buffers of `pool`. `engine_id` names the holder in errors."""

    head_subsets = True

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayoutInfo, pool: StagingPool,
                 engine_id: str) -> None:
        self.kv_cache, self.layout, self.pool = kv_cache, layout, pool
        self.engine_id = engine_id

    def hello(self) -> dict[str, Any]:
        return {"ok": True}

    def greeted(self, peer: KVEndpointInfo, reply: dict[str, Any]) -> None:
        """Nothing to learn from a tcp holder's hello."""

    def session(self, peer: KVEndpointInfo, remaining: Remaining
                ) -> contextlib.nullcontext[dict[str, Any]]:
        return contextlib.nullcontext({})

    def send(self, out: Outgoing) -> None:
        """Through a host buffer; the first chunk is copied before the header, so a device
        that refuses the copy is a typed refusal, not a cut stream."""
        heads = out.heads or (0, int(self.kv_cache.shape[4]))
        nbytes = wire_bytes(self.kv_cache, len(out.blocks), heads)
        try:
            self.pool.send(out.conn, out.blocks, heads, DATA_TIMEOUT_S,
                           lambda: send_msg(out.conn, {"ok": True, "nbytes": nbytes}))
        except TransferError as err:  # no buffer came free
            raise DataUnavailable(f"holder {self.engine_id}: {err}") from None
        except StagingCopyError as err:
            why = (f"holder {self.engine_id} could not copy its "
                   f"{self.kv_cache.device.type} KV blocks for {out.peer}: {err}")
            log.warning("%s", why)
            if err.began:
                raise ConnectionAbortedError(why) from None
            raise DataUnavailable(why) from None

    def receive(self, pull: Incoming) -> int:
        local, want = expected(self.kv_cache, self.layout, pull)
        if not want:
            return 0
        return self.pool.receive(pull.sock, pull.dst, local, pull.remaining,
                                 pull.peer.address)

    def close(self) -> None:
        self.pool.close()
