"""The KV transfer contract (docs/design.md §5): pull-based, one shape for every transport.

Holder (prefill) side: `start(kv_cache, engine_id)` registers the cache once and returns
the `KVEndpointInfo` peers use (`baton.common.internal`: the same type travels in
`KVTransferParams`, its layout a `KVLayoutInfo`); `hold(request_id, block_ids, ttl_s)` pins blocks under a
lease and returns its id (random, unguessable, never derived from the request id: only the
puller it is handed to can name it); `released()` reports, exactly once per lease, that it
ended (pulled, expired, or `release`d by the holder) so the engine can free the request's
blocks.

Puller (decode) side: `connect(peer)` is idempotent and rejects a layout mismatch or a peer
that fails the handshake; `pull(peer, lease_id, src_block_ids, dst_block_ids, timeout_s)`
returns a `Transfer` at once — a small state machine (PENDING -> TRANSFERRING -> DONE |
FAILED) that the engine loop polls; it never blocks the step. Failures are typed
(`TransferError` subclasses).

The cache is the engine's one tensor `[layers, 2 (K/V), blocks, block_size, kv_heads,
head_dim]`; a block's bytes are its `layers x 2` slices, gathered in that order. It may
live on any device: every transport starts, serves and pulls without a host view of a
device cache, and a layout names the device type, so peers whose caches live on different
kinds of device refuse each other at the handshake.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo


class TransferError(RuntimeError):
    """A transfer failed; the decode side recomputes or fails the request."""


class LayoutMismatchError(TransferError):
    """The peers' KV caches differ in shape or dtype: their blocks are not interchangeable."""


class PeerUnreachableError(TransferError):
    """The holder could not be reached, or went away mid-transfer."""


class TransferTimeoutError(TransferError):
    """The transfer did not finish within its timeout."""


class LeaseExpiredError(TransferError):
    """The holder no longer has the blocks for us (lease expired, released, never existed,
    or claimed by another puller), or we asked for blocks outside the lease."""


class KVAuthError(TransferError):
    """The peers could not authenticate each other: one has a KV secret and the other none,
    or their secrets differ. Configure the same internal token on both."""


def bytes_per_block(layout: KVLayoutInfo) -> int:
    """A block's bytes in a cache of `layout` (its `layers x 2` slices of this rank's heads)."""
    elt = torch.empty(0, dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim \
        * elt


def rank_heads(rank: int, size: int, total: int) -> tuple[int, int]:
    """The global KV heads rank `rank` of `size` holds (`models/layers.py`'s
    `column_linear`): an equal slice, or the one head `rank * total // size` replicated
    when there are fewer heads than ranks."""
    if total >= size:
        per = total // size
        return rank * per, (rank + 1) * per
    h = rank * total // size
    return h, h + 1


def _plan(lo: int, hi: int, peers: list[KVEndpointInfo]
          ) -> tuple[list[tuple[KVEndpointInfo, tuple[int, int]]], int]:
    plan = []
    for peer in sorted(peers, key=lambda p: p.layout.head_start):
        a, b = peer.layout.heads
        a, b = max(a, lo), min(b, hi)
        if a < b and a == lo:  # contiguous from where we are
            plan.append((peer, (a, b)))
            lo = b
    return plan, lo


def head_plan(mine: KVLayoutInfo, peers: list[KVEndpointInfo], rank: int | None = None
              ) -> list[tuple[KVEndpointInfo, tuple[int, int], tuple[int, int]]]:
    """Which global heads to pull from which peer (`peers`: the holder's rank endpoints) so that every head of `mine` arrives exactly once, and
    the part (i, n) of that peer's lease this pull is (n: how many of our `tp_size` ranks
    read from that peer; `rank`: ours, found from our heads when not given). Raises
    LayoutMismatchError when the shapes differ or some head is held by no peer."""
    for peer in peers:
        why = mine.mismatch(peer.layout)
        if why:
            raise LayoutMismatchError(f"the holder's KV layout is incompatible with ours: "
                                      f"{why} (holder {peer.layout}, ours {mine})")
    plan, lo = _plan(*mine.heads, peers)
    if lo < mine.heads[1]:
        raise LayoutMismatchError(f"KV heads [{lo}, {mine.heads[1]}) of ours are held by no "
                                  f"rank of the holder (ranks hold "
                                  f"{[p.layout.heads for p in peers]})")
    size, total = mine.tp_size, mine.total_kv_heads
    if rank is None:
        rank = next((q for q in range(size) if rank_heads(q, size, total) == mine.heads), 0)
    readers = {id(p): [q for q in range(size) for pp, _ in
                       _plan(*rank_heads(q, size, total), peers)[0] if pp is p]
               for p, _ in plan}
    return [(p, heads, (readers[id(p)].index(rank), len(readers[id(p)])))
            for p, heads in plan]


def unread_peers(mine: KVLayoutInfo, peers: list[KVEndpointInfo]) -> list[KVEndpointInfo]:
    """The holder ranks none of our ranks reads (their heads replicated on another rank
    that is read): a puller releases their lease copies with an empty pull."""
    size, total = mine.tp_size, mine.total_kv_heads
    read = {id(p) for q in range(size) for p, _ in _plan(*rank_heads(q, size, total), peers)[0]}
    return [p for p in peers if id(p) not in read]


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class Transfer:
    """One pull's progress, advanced by the transport's worker, read by the engine loop."""

    def __init__(self, request_id: str, num_blocks: int) -> None:
        self.request_id = request_id
        self.num_blocks = num_blocks
        self.state = TransferState.PENDING
        self.error: TransferError | None = None
        self.bytes = 0
        self.started = time.monotonic()
        self.finished: float | None = None
        self._done = threading.Event()

    @property
    def is_finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def poll(self) -> TransferState:
        return self.state

    def wait(self, timeout: float | None = None) -> TransferState:
        """For tests and tools; the engine polls instead."""
        self._done.wait(timeout)
        return self.state

    # -- transport side --------------------------------------------------------------------
    def _transferring(self) -> None:
        self.state = TransferState.TRANSFERRING

    def _succeed(self, nbytes: int) -> None:
        self.bytes = nbytes
        self.finished = time.monotonic()
        self.state = TransferState.DONE
        self._done.set()

    def _fail(self, error: TransferError) -> None:
        self.error = error
        self.finished = time.monotonic()
        self.state = TransferState.FAILED
        self._done.set()


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes: torch has no index_copy_ for them and gloo cannot send
    them; every other dtype as it is."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes in wire order: `[layers, 2, n, block_size, kv_heads, head_dim]`
    (of the cache's dtype, or uint8 for FP8)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return wire_view(kv_cache).index_select(2, index)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    wire_view(kv_cache).index_copy_(2, index, wire_view(data))


def check_pull(layout: KVLayoutInfo, src: list[int], dst: list[int], num_blocks: int) -> None:
    """Puller side, before anything moves: one destination per source, each side's ids
    distinct, destinations inside our cache, sources non-negative (the holder checks them
    against its own cache and the lease)."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    bad = [b for b in dst if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"destination blocks {bad[:5]} outside [0, {num_blocks})")
    if any(b < 0 for b in src):
        raise ValueError(f"negative source blocks {[b for b in src if b < 0][:5]}")
    for side, ids in (("source", src), ("destination", dst)):
        if len(set(ids)) != len(ids):
            raise ValueError(f"repeated {side} blocks in {ids[:10]}")


class KVTransport(ABC):
    name: str

    @abstractmethod
    def start(self, kv_cache: torch.Tensor, engine_id: str) -> KVEndpointInfo:
        """Register the cache (once) and start serving pulls of held blocks."""

    @abstractmethod
    def connect(self, peer: KVEndpointInfo) -> None:
        """Idempotent; raises LayoutMismatchError or PeerUnreachableError."""

    @abstractmethod
    def pull(self, peer: KVEndpointInfo, lease_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], timeout_s: float) -> Transfer:
        """Start copying the peer's blocks held under `lease_id` into ours; returns at once.
        Raises ValueError for ids `check_pull` refuses; everything else fails the Transfer
        (`KVAuthError` when the peers' secrets disagree). An empty pull releases the lease.
        The first puller to claim a lease owns it: others are refused (LeaseExpiredError)."""

    @abstractmethod
    def hold(self, request_id: str, block_ids: list[int], ttl_s: float) -> str:
        """Holder side: keep these blocks for a puller until pulled or `ttl_s` passes;
        returns the lease id to hand to that puller. ValueError if `request_id` already
        holds a lease or a block id is outside the cache."""

    @abstractmethod
    def release(self, lease_id: str) -> bool:
        """Holder side, the holder's own call (its router says nobody will pull): end the
        lease now. False when it is not held or is being pulled. Thread-safe."""

    @abstractmethod
    def released(self) -> list[tuple[str, str]]:
        """Holder side: (request_id, "pulled" | "expired" | "released") for leases that
        ended since the last call; each lease appears exactly once."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving; pending pulls fail, held leases are reported released."""
