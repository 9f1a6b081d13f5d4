"""KV transfer across tensor-parallel ranks, rank 0's side (`runner/tp_kv.py` is a
follower's): each rank's cache holds its own KV heads, so each rank serves and pulls its
own heads over its own tcp transport, and rank 0 drives the followers through the TP
leader's control frames.

Holder (prefill at TP=N): rank 0 makes the lease and sends each follower a copy (same id,
blocks, TTL); the `KVTransferParams` name every rank's endpoint and heads. The request's
blocks are freed only once rank 0's lease and every follower's copy have ended (pulled,
expired, released: a follower reports it), so no rank's blocks are reused under a reader.

Puller (decode at TP=M): rank 0 pulls its heads from the holder ranks that have them
(`head_plan`) and tells each follower to pull its own; the request's `RankedTransfer` is
finished only when every rank's pulls are, and failed if any failed (the engine then
recomputes or fails the request, as for one rank).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from baton.common.internal import KVEndpointInfo, KVTransferParams
from baton.engine.runner.tp_kv_messages import (
    KVHold,
    KVPull,
    KVPulled,
    KVRelease,
    KVReleased,
    KVStart,
    KVStarted,
)
from baton.kv_transfer import base as kvb
from baton.kv_transfer.base import Transfer, TransferError, TransferState

START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TensorParallelKV:
    """What a tensor-parallel engine tells its KV connector (tcp only): every rank serves and
    pulls its own KV heads, and rank 0 drives the followers through the TP leader."""

    leader: object | None  # rank 0's `TPLeader` (runner/tp.py); None on a follower
    first_head: int        # this rank's first KV head of the model's
    num_heads: int         # the model's KV heads
    size: int              # the TP degree

    @property
    def heads(self) -> tuple[int, int, int]:
        """(first head, the model's KV heads, TP size): a transport's `heads=`."""
        return (self.first_head, self.num_heads, self.size)
_ERRORS = {cls.__name__: cls for cls in (
    kvb.LayoutMismatchError, kvb.PeerUnreachableError, kvb.TransferTimeoutError,
    kvb.LeaseExpiredError, kvb.KVAuthError, TransferError)}


class RankedTransfer:
    """One request's pull over every rank, read by the connector like a `Transfer`."""

    def __init__(self, request_id: str, local: list[Transfer], followers: set[int]) -> None:
        self.request_id = request_id
        self.local, self.waiting = local, set(followers)
        self.follower_errors: list[TransferError] = []
        self.follower_bytes = 0
        self.started = time.monotonic()
        self.finished: float | None = None
        self.state, self.bytes = TransferState.PENDING, 0
        self.error: TransferError | None = None

    def follower_done(self, rank: int, reply: KVPulled) -> None:
        self.waiting.discard(rank)
        self.follower_bytes += reply.bytes
        if not reply.ok:
            cls = _ERRORS.get(reply.kind, TransferError)
            self.follower_errors.append(cls(f"rank {rank}: {reply.error}"))

    @property
    def is_finished(self) -> bool:
        if self.finished is None and not self.waiting and all(t.is_finished
                                                              for t in self.local):
            errors = [t.error for t in self.local if t.state != TransferState.DONE]
            errors += self.follower_errors
            self.finished = max([t.finished or 0.0 for t in self.local] + [time.monotonic()])
            self.bytes = sum(t.bytes for t in self.local) + self.follower_bytes
            self.error = errors[0] if errors else None
            self.state = TransferState.FAILED if errors else TransferState.DONE
        return self.finished is not None


def peers_of(params: KVTransferParams) -> list[KVEndpointInfo]:
    """The holder's rank endpoints a `KVTransferParams` names (one for TP=1)."""
    return params.rank_endpoints or [params.endpoint]


def pull_heads(transport, peers: list[KVEndpointInfo], lease_id: str, src: list[int],
               dst: list[int], timeout_s: float, rank: int = 0) -> list[Transfer]:
    """This rank's pulls: its heads from the holder ranks that hold them."""
    plan = kvb.head_plan(transport.layout, peers, rank)
    if rank == 0:  # copies nobody reads (replicated heads): released now, not at their TTL
        for peer in kvb.unread_peers(transport.layout, peers):
            transport.pull(peer, lease_id, [], [], timeout_s)
    if len(plan) == 1 and plan[0][1] == transport.layout.heads == plan[0][0].layout.heads \
            and plan[0][2] == (0, 1):  # the same shard: every transport's plain pull
        return [transport.pull(plan[0][0], lease_id, src, dst, timeout_s)]
    return [transport.pull(peer, lease_id, src, dst, timeout_s, heads=heads, part=part)
            for peer, heads, part in plan]


class TPRanks:
    """Rank 0's handle on the followers' KV transports."""

    def __init__(self, leader, engine_id: str, rank0: KVEndpointInfo) -> None:
        self.leader = leader
        leader.send_control(KVStart(engine_id=engine_id))
        found: dict[int, KVEndpointInfo] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(found) < len(leader.procs):
            if time.monotonic() > deadline:
                raise RuntimeError("tensor-parallel ranks did not start their KV transport")
            leader.raise_if_failed()
            for rank, reply in leader.replies(0.1):
                if not isinstance(reply, KVStarted):
                    continue
                if reply.error is not None or reply.endpoint is None:
                    raise RuntimeError(f"tensor-parallel rank {rank} could not start its KV "
                                       f"transport: {reply.error}")
                found[rank] = reply.endpoint
        self.endpoints = [rank0] + [found[r] for r in sorted(found)]
        self._pulls: dict[str, RankedTransfer] = {}
        self._copies: dict[str, set[int]] = {}  # lease id -> followers still holding it

    @property
    def followers(self) -> list[int]:
        return list(range(1, len(self.endpoints)))

    # -- holder ----------------------------------------------------------------------------
    def hold(self, lease_id: str, block_ids: list[int], ttl_s: float) -> None:
        self.leader.send_control(KVHold(lease=lease_id, blocks=block_ids, ttl=ttl_s))
        self._copies[lease_id] = set(self.followers)

    def release(self, lease_id: str) -> None:
        """Rank 0's lease ended unpulled: end the followers' copies (one being read ends
        when its read does)."""
        if self._copies.get(lease_id):
            self.leader.send_control(KVRelease(lease=lease_id), sorted(self._copies[lease_id]))

    def copies_ended(self, lease_id: str) -> bool:
        if self._copies.get(lease_id):
            return False
        self._copies.pop(lease_id, None)
        return True

    # -- puller ----------------------------------------------------------------------------
    def pull(self, transport, params, src: list[int], dst: list[int], timeout_s: float,
             request_id: str) -> RankedTransfer:
        peers = peers_of(params)
        local = pull_heads(transport, peers, params.lease_id, src, dst, timeout_s)
        tag = uuid.uuid4().hex
        self.leader.send_control(KVPull(tag=tag, lease=params.lease_id,
                                        peers=peers, src=src, dst=dst,
                                        timeout=timeout_s))
        self._pulls[tag] = RankedTransfer(request_id, local, set(self.followers))
        return self._pulls[tag]

    # -- every step ------------------------------------------------------------------------
    def poll(self) -> None:
        """Take the followers' replies: finished pulls, ended lease copies."""
        for rank, reply in self.leader.replies():
            if isinstance(reply, KVPulled) and reply.tag is not None:
                transfer = self._pulls.get(reply.tag)
                if transfer is not None:
                    transfer.follower_done(rank, reply)
                    if not transfer.waiting:
                        del self._pulls[reply.tag]
            elif isinstance(reply, KVReleased):
                self._copies.get(reply.lease, set()).discard(rank)
