"""`TransportKVConnector`: the KV connector over a `baton.kv_transfer` transport.

Prefill side: a request made with `HoldKV` runs its prompt and samples one token; when it
ends normally its blocks go under a lease with the transport and its final output carries
the `KVTransferParams`, with the lease id the transport made up (random: a client's request
id never reaches the wire). When the lease ends (pulled, or expired) `poll()` frees the
blocks. With a secret (`EngineConfig.kv_secret`, the internal token) the transport only
serves, and only pulls from, peers that prove the same secret.

Decode side: a request made with `PullKV` is admitted with blocks for its prompt (local
prefix-cache hits are not pulled), waits in WAITING_FOR_REMOTE_KV while its pull runs, and
joins the running batch when the pull is done. A failed pull prefills locally
(`failure_policy="recompute"`) or ends the request (`"fail"`). A request that ends before
its pull starts (stopped on the prefill's first token, aborted while queued) releases the
lease at once; one aborted mid-pull keeps its blocks until the pull stops writing.
"""

from __future__ import annotations

import collections
import logging
import uuid

from baton.common.internal import KVTransferParams
from baton.engine.config import LiveKVSettings
from baton.engine.kv_connector.base import KVConnector, KVConnectorStats, KVUpdates
from baton.engine.kv_connector.handoff import HoldKV, PullKV, after_load, peer_prefix
from baton.engine.kv_connector.tp_ranks import (
    RankedTransfer,
    TensorParallelKV,
    TPRanks,
    peers_of,
    pull_heads,
)
from baton.engine.request import Request, RequestStatus
from baton.kv_transfer import make_transport
from baton.kv_transfer.base import (
    KVAuthError,
    LeaseExpiredError,
    PeerUnreachableError,
    Transfer,
    TransferError,
    TransferState,
    TransferTimeoutError,
)
from baton.kv_transfer.leases import short

log = logging.getLogger(__name__)
_NORMAL_END = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class TransportKVConnector(KVConnector):
    def __init__(self, transport: str, kv_cache, engine_id: str | None,
                 live: LiveKVSettings, host: str = "127.0.0.1", port: int = 0,
                 secret: str | None = None, tp: TensorParallelKV | None = None) -> None:
        """`tp` on a tensor-parallel engine (tcp only): every rank serves and pulls its own
        heads."""
        kwargs: dict = {} if transport == "local" else {"host": host, "port": port}
        if tp is not None and tp.size > 1:
            if transport != "tcp":
                raise ValueError(f"KV transfer of a tensor-parallel engine runs over tcp "
                                 f"(not {transport}): gloo / nccl / nixl move whole shards "
                                 "only (tcp stages a GPU cache through host memory)")
            kwargs["heads"] = tp.heads
        self.transport = make_transport(transport, secret=secret, **kwargs)
        engine_id = engine_id or uuid.uuid4().hex[:12]
        self.endpoint = self.transport.start(kv_cache, engine_id)
        self.ranks = None if tp is None or tp.leader is None else \
            TPRanks(tp.leader, engine_id, self.endpoint)
        self._lease_ids: dict[str, str] = {}  # TP holder: request id -> lease id
        self._draining: dict[str, str] = {}  # TP holder: lease id -> request id, ranks' copies
        self.block_size = kv_cache.shape[3]
        self.live = live
        self.stats = KVConnectorStats()
        self._loading: dict[str, tuple[Transfer | RankedTransfer, Request]] = {}
        self._not_started: dict[str, tuple[Request, str]] = {}  # loads that failed to start
        self._aborted: set[str] = set()  # ended while loading: free when the load stops
        self._held: dict[str, Request] = {}  # prefill: under a lease
        self._durations: collections.deque[float] = collections.deque()

    # -- admission (decode) ----------------------------------------------------------------
    def num_remote_tokens(self, req: Request, num_cached: int) -> int:
        handoff = req.kv_handoff
        if isinstance(handoff, PullKV):
            return req.num_prompt_tokens - num_cached
        peer = peer_prefix(handoff)
        if peer is None:
            return 0
        remote = peer.num_tokens - num_cached  # whole blocks: both are
        if remote <= 0:  # this pool holds the peer's prefix already: nothing to pull
            self.stats.fallback("peer_prefix_cached")
            self._release_unpulled(peer)
            req.kv_handoff = after_load(handoff)
            return 0
        return remote

    def loads_locally(self, req: Request) -> bool:
        """A peer's prefix counts as cached in the request's usage (this pod did not
        compute it for this request); a P/D pull's prompt does not."""
        return peer_prefix(req.kv_handoff) is not None

    def start_load(self, req: Request, block_ids: list[int], num_cached: int) -> None:
        handoff = req.kv_handoff
        params = handoff.params if isinstance(handoff, PullKV) else peer_prefix(handoff)
        assert params is not None  # loads start only where num_remote_tokens counted
        first = num_cached // self.block_size  # local prefix hits are not pulled
        last = -(-min(params.num_tokens, req.num_prompt_tokens) // self.block_size)
        src, dst = params.block_ids[first:last], block_ids[first:last]
        try:
            peers = peers_of(params)
            if any(p.transport != self.transport.name for p in peers):
                raise ValueError(f"the holder serves KV over {peers[0].transport}, this "
                                 f"engine pulls over {self.transport.name}")
            timeout = self.live.transfer_timeout_s
            transfer: Transfer | RankedTransfer
            if self.ranks is not None:
                transfer = self.ranks.pull(self.transport, params, src, dst, timeout,
                                           req.request_id)
            else:
                local = pull_heads(self.transport, peers, params.lease_id, src, dst, timeout)
                transfer = local[0] if len(local) == 1 else \
                    RankedTransfer(req.request_id, local, set())
        except (ValueError, TransferError) as err:
            self._not_started[req.request_id] = (req, f"cannot pull: {err}")
            return
        self._loading[req.request_id] = (transfer, req)

    @property
    def num_loading(self) -> int:
        return len(self._loading) + len(self._not_started)

    # -- every step ------------------------------------------------------------------------
    def poll(self) -> KVUpdates:
        updates = KVUpdates()
        self._leases_ended(updates)
        for req, why in self._not_started.values():
            self.stats.transfers += 1
            self.stats.failures += 1
            self._fail(req, TransferError(why), updates)
        self._not_started = {}
        for rid, (transfer, req) in list(self._loading.items()):
            if transfer.is_finished:
                del self._loading[rid]
                self._load_ended(transfer, req, updates)
        return updates

    def _leases_ended(self, updates: KVUpdates) -> None:
        """Holder: free the blocks of leases that ended (on a tensor-parallel engine, once
        every rank's copy has ended too)."""
        if self.ranks is not None:
            self.ranks.poll()
        for rid, reason in self.transport.released():
            if self.ranks is not None and rid in self._lease_ids:
                lease_id = self._lease_ids.pop(rid)
                if reason != "pulled":  # nobody will read the other ranks' copies either
                    self.ranks.release(lease_id)
                self._draining[lease_id] = rid
                continue
            held = self._held.pop(rid, None)
            if held is not None:
                updates.freeable.append(held)
        for lease_id, rid in list(self._draining.items()):
            assert self.ranks is not None  # only a TP holder (with ranks) drains leases
            if self.ranks.copies_ended(lease_id):
                del self._draining[lease_id]
                updates.freeable.append(self._held.pop(rid))

    def _load_ended(self, t: Transfer | RankedTransfer, req: Request, updates: KVUpdates
                    ) -> None:
        self.stats.transfers += 1
        if t.finished is not None:
            self._durations.append(t.finished - t.started)
            req.kv_transfer_time = t.finished - t.started
        if req.request_id in self._aborted:
            self._aborted.discard(req.request_id)
            updates.freeable.append(req)
        elif t.state == TransferState.DONE:
            self.stats.bytes += t.bytes
            updates.loaded.append(req)
        else:
            self.stats.failures += 1
            self._fail(req, t.error, updates)

    def _fail(self, req: Request, error: TransferError | None, updates: KVUpdates) -> None:
        """A failed P/D pull follows the failure policy; a peer's prefix always recomputes
        (it only saved work), counted as `peer_<reason>`."""
        peer = peer_prefix(req.kv_handoff) is not None
        policy = "recompute" if peer else self.live.failure_policy
        log.warning("pulling the KV of %s failed (%s); policy %s", req.request_id, error,
                    policy)
        if policy == "recompute":
            self.stats.fallback(("peer_" if peer else "") + fallback_reason(error))
            updates.recompute.append(req)
        else:
            updates.failed.append((req, f"KV transfer failed: {error}"))

    @property
    def has_pending(self) -> bool:
        return bool(self._loading or self._not_started or self._held)

    # -- the end of a request --------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        rid, handoff = req.request_id, req.kv_handoff
        if rid in self._loading:  # its pull may still be writing into its blocks
            self._aborted.add(rid)
            return True, None
        if self._not_started.pop(rid, None) is not None:
            return False, None
        if isinstance(handoff, PullKV):  # ended before its pull started
            self._release_unpulled(handoff.params)
        elif (peer := peer_prefix(handoff)) is not None:  # likewise, a peer's prefix
            self._release_unpulled(peer)
        elif isinstance(handoff, HoldKV) and req.status in _NORMAL_END:
            return True, self._lease(req, block_ids)
        return False, None

    def _lease(self, req: Request, block_ids: list[int]) -> KVTransferParams:
        ttl = self.live.lease_ttl_s
        lease_id = self.transport.hold(req.request_id, block_ids, ttl)
        self._held[req.request_id] = req
        if self.ranks is not None:
            self.ranks.hold(lease_id, block_ids, ttl)
            self._lease_ids[req.request_id] = lease_id
        return KVTransferParams(endpoint=self.endpoint, block_ids=block_ids,
                                num_tokens=req.num_prompt_tokens, lease_id=lease_id,
                                first_token=req.output_token_ids[-1], lease_ttl_s=ttl,
                                rank_endpoints=None if self.ranks is None
                                else self.ranks.endpoints)

    def release_lease(self, lease_id: str) -> bool:
        """Holder side: end a lease nobody will pull (its router says so); the request's
        blocks come back in a later `poll()`. False when it is not held or being pulled.
        Any thread: it touches only the transport's (locked) lease table."""
        return self.transport.release(lease_id)

    def _release_unpulled(self, params: KVTransferParams) -> None:
        """Tell the holder we will not pull: an empty pull ends the lease at once instead
        of after its TTL."""
        try:  # every rank of a tensor-parallel holder keeps a copy of the lease
            for peer in peers_of(params):
                self.transport.pull(peer, params.lease_id, [], [],
                                    self.live.transfer_timeout_s)
        except (ValueError, TransferError) as err:
            log.warning("could not release lease %s: %s", short(params.lease_id), err)

    # -- operations ------------------------------------------------------------------------
    def reconfigure(self, live: LiveKVSettings) -> None:
        self.live = live

    def take_transfer_durations(self) -> list[float]:
        out = []
        while self._durations:
            out.append(self._durations.popleft())
        return out

    @property
    def num_leases_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self.transport.close()


def fallback_reason(error: TransferError | None) -> str:
    """The `baton:fallbacks_total` reason of a failed pull."""
    for kind, reason in ((KVAuthError, "kv_auth"),
                         (TransferTimeoutError, "transfer_timeout"),
                         (PeerUnreachableError, "kv_peer_lost"),
                         (LeaseExpiredError, "lease_expired")):
        if isinstance(error, kind):
            return reason
    return "transfer_failed"
