"""The gloo / nccl transports' data plane: torch.distributed point-to-point, `gloo` on CPU
caches, `nccl` on CUDA ones.

The control plane is every network transport's (`network.py`: bounded frames, the
handshake with the layout fingerprint and the secret's challenge, pull, ack, leases); the
bytes go over a two-rank process group per peer pair (`pairs.py`), built on the
first pull between two engines and reused: the holder (rank 0) opens a `TCPStore` on a
free port and says which in its reply, naming the new group; later replies name the group
the puller already has, with the tag of this pull's message. The holder gathers the
blocks into one contiguous tensor and `send`s it, the puller `recv`s it into a staging
tensor on its own device and scatters it into its destination blocks: one large message,
because many small sends are slow on gloo. On CUDA both run on a side stream of the pair
(after the engine's queued work, not in the way of its later steps), and a transfer waits
on that stream's work alone. Neither side ever views a cache from the host. (The store
takes no secret: its port, random, is told only to a puller that passed the handshake; it
lives as long as its pair.)
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # where torch.distributed's comes from

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer.base import (
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
    gather_blocks,
    scatter_blocks,
    wire_view,
)
from baton.kv_transfer.dataplane import DataUnavailable, Incoming, Outgoing, Remaining
from baton.kv_transfer.pairs import Pair, PairTable, build_group, destroy
from baton.kv_transfer.staging import on_stream, side_stream, wait_for
from baton.kv_transfer.wire import send_msg

log = logging.getLogger(__name__)
_SETUP = timedelta(seconds=30)
_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def _finish(work: dist.Work, seconds: float, cuda: bool) -> None:
    """Wait for a send / recv: gloo's own timed wait; NCCL's work polled up to the
    deadline (its wait() only orders the current stream), then waited to raise its error
    and order the current (side) stream after it."""
    if not cuda:
        if not work.wait(timedelta(seconds=max(seconds, 0.001))):
            raise TimeoutError("the send / recv timed out")
        return
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError("the send / recv timed out")
        time.sleep(0.0005)
    work.wait()


def _typed(err: Exception, address: str) -> TransferError:
    """gloo / NCCL errors: tell a timeout from a lost peer."""
    text = str(err).lower()
    if isinstance(err, TimeoutError) or "timed out" in text or "timeout" in text:
        return TransferTimeoutError(f"the transfer with {address} timed out: {err}")
    return PeerUnreachableError(f"lost {address} during the transfer: {err}")


class GlooPlanes:
    """`backend`: gloo (CPU caches) or nccl (CUDA caches); the holder's stores listen on
    `host`, the control plane's."""

    def __init__(self, host: str, backend: str = "gloo") -> None:
        if backend not in _DEVICE:
            raise ValueError(f"backend={backend!r}: one of {sorted(_DEVICE)}")
        self.host, self.backend = host, backend

    def open(self, kv_cache: torch.Tensor, layout: KVLayoutInfo, engine_id: str
             ) -> GlooPlane:
        want = _DEVICE[self.backend]
        if kv_cache.device.type != want:
            raise ValueError(f"the {self.backend} transport moves {want} caches, not a "
                             f"{kv_cache.device.type} one: use "
                             f"{'nccl' if want == 'cpu' else 'gloo'} or tcp")
        return GlooPlane(kv_cache, layout, engine_id, self.host, self.backend)


class GlooPlane:
    """The bytes of whole shards over pair groups (`pairs`: the holder's by puller
    identity, the puller's by holder address)."""

    head_subsets = False

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayoutInfo, engine_id: str,
                 host: str, backend: str) -> None:
        self.kv_cache, self.layout, self.engine_id = kv_cache, layout, engine_id
        self.host, self.backend = host, backend
        self.cuda = kv_cache.device.type == "cuda"
        self.pairs = PairTable()

    def hello(self) -> dict[str, Any]:
        return {"ok": True}

    def greeted(self, peer: KVEndpointInfo, reply: dict[str, Any]) -> None:
        """The group is built on the first pull, not on connect."""

    # -- holder ----------------------------------------------------------------------------
    def send(self, out: Outgoing) -> None:
        if not out.blocks:
            send_msg(out.conn, {"ok": True, "nbytes": 0})
            return
        with self.pairs.lock(out.peer):
            pair = self.pairs.get(out.peer)
            if pair is None or pair.gen != out.request.group:
                # a new puller, a restarted one, or one that dropped its group
                self._send_fresh(out)
                return
            self._send_on(out, pair, {})

    def _send_fresh(self, out: Outgoing) -> None:
        self.pairs.drop(out.peer)
        store = TCPStore(self.host, 0, 2, True, timeout=_SETUP, wait_for_workers=False)
        pair = Pair(uuid.uuid4().hex[:16], store, None, side_stream(self.kv_cache.device))
        self._send_on(out, pair, {"store_port": store.port})

    def _send_on(self, out: Outgoing, pair: Pair, extra: dict[str, Any]) -> None:
        stream = pair.stream
        try:
            with on_stream(stream):
                data = gather_blocks(self.kv_cache, out.blocks).contiguous()  # [L,2,n,bs,h,d]
        except RuntimeError as err:  # the device's: before the header, the puller hears
            raise DataUnavailable(f"holder {self.engine_id} could not gather its KV blocks "
                                  f"for {out.peer}: {err!r}") from None
        tag = pair.next_tag()
        send_msg(out.conn, {"ok": True, "nbytes": data.numel() * data.element_size(),
                            "group": pair.gen, "tag": tag, **extra})
        try:
            if pair.group is None:  # blocks until the puller joins
                assert pair.store is not None  # a fresh pair's, kept until it is destroyed
                pair.group = build_group(pair.store, 0, _SETUP, self.backend)
                self.pairs.put(out.peer, pair)
            with on_stream(stream):
                _finish(pair.group.send([data], 1, tag), _SETUP.total_seconds(), self.cuda)
        except (RuntimeError, TimeoutError) as err:
            log.info("KV %s group with %s dropped: %s", self.backend, out.peer, err)
            if self.pairs.get(out.peer) is pair:
                self.pairs.drop(out.peer)
            else:  # never tabled: its store and any half-built group go now
                destroy(pair)
            raise ConnectionAbortedError(str(err)) from None

    # -- puller ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def session(self, peer: KVEndpointInfo, remaining: Remaining
                ) -> Iterator[dict[str, Any]]:
        """One pull at a time per holder; the request names the group we have. A holder
        we cannot reach, or a data phase that fails, costs us our group with it."""
        lock = self.pairs.lock(peer.address)
        if not lock.acquire(timeout=remaining()):
            raise TransferTimeoutError(f"an earlier pull from {peer.address} still runs")
        try:
            pair = self.pairs.get(peer.address)
            yield {"group": pair.gen if pair is not None else None}
        except (OSError, ValueError, PeerUnreachableError, TransferTimeoutError):
            self.pairs.drop(peer.address)
            raise
        finally:
            lock.release()

    def receive(self, pull: Incoming) -> int:
        if not pull.src:
            return 0
        address = pull.peer.address
        gen, tag = pull.reply.get("group"), pull.reply.get("tag")
        if not isinstance(gen, str) or type(tag) is not int:
            raise PeerUnreachableError(f"{address} named no group / tag: {pull.reply!r}")
        try:
            pair = self._puller_pair(pull.peer, gen, pull.reply.get("store_port"),
                                     pull.remaining)
            assert pair.group is not None  # a puller's pair is built before it is tabled
            lay = self.layout
            with on_stream(pair.stream):
                staging = wire_view(torch.empty(  # [L, 2, n, bs, h, d]
                    (lay.num_layers, 2, len(pull.src), lay.block_size, lay.num_kv_heads,
                     lay.head_dim), dtype=self.kv_cache.dtype, device=self.kv_cache.device))
                _finish(pair.group.recv([staging], 0, tag), pull.remaining(), self.cuda)
                scatter_blocks(self.kv_cache, pull.dst, staging)
            wait_for(pair.stream)  # our blocks are written (that stream's work only)
        except TransferError:
            raise
        except (RuntimeError, TimeoutError) as err:
            raise _typed(err, address) from None
        return staging.numel() * staging.element_size()

    def _puller_pair(self, peer: KVEndpointInfo, gen: str, port: object,
                     remaining: Remaining) -> Pair:
        """Our group with `peer`: the one we have when the holder names it, or a new one
        on the store the holder just opened."""
        pair = self.pairs.get(peer.address)
        if port is None:
            if pair is None or pair.gen != gen:
                raise PeerUnreachableError(f"{peer.address} reuses group {gen!r}, which we "
                                           "do not have")
            pair.touch()
            return pair
        if type(port) is not int or not 0 < port < 65536:
            raise PeerUnreachableError(f"{peer.address} named no store port: {port!r}")
        self.pairs.drop(peer.address)  # the holder has let go of any older group
        left = timedelta(seconds=remaining())
        store = TCPStore(peer.address.rsplit(":", 1)[0], port, 2, False, timeout=left)
        pair = Pair(gen, store, build_group(store, 1, left, self.backend),
                    side_stream(self.kv_cache.device))
        self.pairs.put(peer.address, pair)
        return pair

    def close(self) -> None:
        self.pairs.close()
