"""The KV transfer contract (docs/design.md §5): pull-based, one shape for every transport.

Holder (prefill) side: `start(layout, kv_cache, engine_id)` registers the cache once and
returns the `Endpoint` peers use; `hold(request_id, block_ids, ttl_s)` pins blocks under a
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
import hashlib
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch


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


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache shape. With tensor parallelism a rank holds `num_kv_heads` of the
    model's `total_kv_heads` (0: all of them), the global heads [head_start, head_start +
    num_kv_heads), one of `tp_size` ranks. The fingerprint covers only what every rank of
    every TP degree shares (layers, block size, total heads, head dim, dtype): peers of
    different TP degrees handshake, and each pull names the heads it moves. The device type
    is part of it too (nixl reads DRAM or VRAM, gloo / nccl need the same kind on both
    sides); a layout on the wire without one is a host cache's."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    total_kv_heads: int = 0
    head_start: int = 0
    tp_size: int = 1
    device: str = "cpu"  # the cache's device type (cpu, cuda): a transport's memory kind

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if not (0 <= self.head_start and self.head_start + self.num_kv_heads
                <= self.total_kv_heads and self.tp_size >= 1):
            raise ValueError(f"heads [{self.head_start}, {self.head_start + self.num_kv_heads})"
                             f" outside the model's {self.total_kv_heads} KV heads "
                             f"(tp_size {self.tp_size})")

    @classmethod
    def of(cls, kv_cache: torch.Tensor, head_start: int = 0, total_kv_heads: int = 0,
           tp_size: int = 1) -> KVLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError("the KV cache must be [layers, 2, blocks, block_size, kv_heads, "
                             f"head_dim], got {tuple(kv_cache.shape)}")
        layers, _, _, bs, kvh, d = kv_cache.shape
        return cls(layers, bs, kvh, d, str(kv_cache.dtype).removeprefix("torch."),
                   total_kv_heads, head_start, tp_size, kv_cache.device.type)

    @property
    def heads(self) -> tuple[int, int]:
        """This rank's global KV heads, [start, end)."""
        return self.head_start, self.head_start + self.num_kv_heads

    @property
    def is_whole(self) -> bool:
        return self.num_kv_heads == self.total_kv_heads

    @property
    def fingerprint(self) -> str:
        raw = f"{self.num_layers}/{self.block_size}/{self.total_kv_heads}/{self.head_dim}/" \
              f"{self.dtype}"
        if self.device != "cpu":  # a host cache's fingerprint as before devices were named
            raw += f"/{self.device}"
        return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()

    def to_dict(self) -> dict:
        """On the wire; a whole cache (TP=1) on the host as before tensor parallelism and
        devices (`KVLayout(**d)` reads both)."""
        d = asdict(self)
        if self.is_whole and self.tp_size == 1:
            for k in ("total_kv_heads", "head_start", "tp_size"):
                del d[k]
        if self.device == "cpu":
            del d["device"]
        return d

    def mismatch(self, other: KVLayout) -> str:
        """What makes two layouts' blocks incompatible whatever their TP degrees ('' when
        nothing does)."""
        diffs = [f"{k} {getattr(self, k)} vs {getattr(other, k)}"
                 for k in ("num_layers", "block_size", "total_kv_heads", "head_dim", "dtype",
                           "device")
                 if getattr(self, k) != getattr(other, k)]
        return ", ".join(diffs)

    @property
    def bytes_per_block(self) -> int:
        elt = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elt


def rank_heads(rank: int, size: int, total: int) -> tuple[int, int]:
    """The global KV heads rank `rank` of `size` holds (`models/layers.py`'s
    `column_linear`): an equal slice, or the one head `rank * total // size` replicated
    when there are fewer heads than ranks."""
    if total >= size:
        per = total // size
        return rank * per, (rank + 1) * per
    h = rank * total // size
    return h, h + 1


def _plan(lo: int, hi: int, peers: list) -> tuple[list, int]:
    plan = []
    for peer in sorted(peers, key=lambda p: p.layout.head_start):
        a, b = peer.layout.heads
        a, b = max(a, lo), min(b, hi)
        if a < b and a == lo:  # contiguous from where we are
            plan.append((peer, (a, b)))
            lo = b
    return plan, lo


def head_plan(mine: KVLayout, peers: list, rank: int | None = None
              ) -> list[tuple[object, tuple[int, int], tuple[int, int]]]:
    """Which global heads to pull from which peer (`peers`: objects with a `.layout`, e.g.
    the holder's rank `Endpoint`s) so that every head of `mine` arrives exactly once, and
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


def unread_peers(mine: KVLayout, peers: list) -> list:
    """The holder ranks none of our ranks reads (their heads replicated on another rank
    that is read): a puller releases their lease copies with an empty pull."""
    size, total = mine.tp_size, mine.total_kv_heads
    read = {id(p) for q in range(size) for p, _ in _plan(*rank_heads(q, size, total), peers)[0]}
    return [p for p in peers if id(p) not in read]


@dataclass(frozen=True)
class Endpoint:
    """How peers reach a holder; travels in `kv_transfer_params` as a dict."""

    transport: str
    engine_id: str
    address: str
    layout: KVLayout

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layout"] = self.layout.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Endpoint:
        return cls(d["transport"], d["engine_id"], d["address"], KVLayout(**d["layout"]))


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


def check_pull(layout: KVLayout, src: list[int], dst: list[int], num_blocks: int) -> None:
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
    def start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        """Register the cache (once) and start serving pulls of held blocks."""

    @abstractmethod
    def connect(self, peer: Endpoint) -> None:
        """Idempotent; raises LayoutMismatchError or PeerUnreachableError."""

    @abstractmethod
    def pull(self, peer: Endpoint, lease_id: str, src_block_ids: list[int],
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
