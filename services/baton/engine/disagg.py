"""The engine's side of disaggregation: leases on a prefill engine, pulls on a decode engine.

Prefill: a request made with `hold_kv=True` runs its prompt and samples one token; when it
ends, the scheduler keeps its blocks (`Scheduler.held`) and this coordinator puts them under
a lease with the transport; the final output carries `kv_transfer_params`. When the lease
ends (pulled, or expired) the blocks are freed.

Decode: a request made with `remote_kv` is admitted with blocks for its prompt (local
prefix-cache hits are not pulled), waits in WAITING_FOR_REMOTE_KV while its pull runs, and
joins the running batch when the pull is done. A failed pull prefills locally
(`kv_failure_policy="recompute"`) or ends the request (`"fail"`). The step loop only polls.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from baton.engine.request import RemoteKV, Request
from baton.engine.scheduler.scheduler import Scheduler
from baton.kv_transfer import make_transport
from baton.kv_transfer.base import (Endpoint, LeaseExpiredError, PeerUnreachableError,
                                    Transfer, TransferError, TransferState,
                                    TransferTimeoutError)

log = logging.getLogger(__name__)


@dataclass
class KVTransferStats:
    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)  # drained by the metrics layer
    fallbacks: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


class KVCoordinator:
    def __init__(self, name: str, kv_cache, engine_id: str | None, scheduler: Scheduler,
                 lease_ttl_s: float, timeout_s: float, failure_policy: str,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.transport = make_transport(name, **({} if name == "local" else {
            "host": host, "port": port}))
        self.endpoint = self.transport.start(kv_cache, engine_id or uuid.uuid4().hex[:12])
        self.scheduler = scheduler
        self.lease_ttl_s = lease_ttl_s
        self.timeout_s = timeout_s
        self.failure_policy = failure_policy
        self.block_size = kv_cache.shape[3]
        self.transfers: dict[str, tuple[Transfer, Request]] = {}
        self.stats = KVTransferStats()

    # -- prefill ---------------------------------------------------------------------------
    def lease(self, req: Request, block_ids: list[int], first_token: int) -> dict:
        """Put a finished prefill's blocks under a lease; returns `kv_transfer_params`."""
        self.transport.hold(req.request_id, block_ids, self.lease_ttl_s)
        return {"endpoint": self.endpoint.to_dict(), "block_ids": block_ids,
                "num_tokens": req.num_prompt_tokens, "lease_id": req.request_id,
                "first_token": first_token, "lease_ttl_s": self.lease_ttl_s}

    # -- decode ----------------------------------------------------------------------------
    def start_pulls(self, block_ids_of) -> None:
        for req in self.scheduler.take_remote_started():
            rk = req.remote_kv
            first = req.num_cached_tokens // self.block_size
            last = -(-req.num_prompt_tokens // self.block_size)
            src, dst = rk.block_ids[first:last], block_ids_of(req.request_id)[first:last]
            try:
                peer = Endpoint.from_dict(rk.peer)
                if peer.transport != self.transport.name:
                    raise ValueError(f"the holder serves KV over {peer.transport}, this "
                                     f"engine pulls over {self.transport.name}")
                t = self.transport.pull(peer, rk.lease_id, src, dst, self.timeout_s)
            except (ValueError, KeyError, TypeError) as err:
                t = Transfer(req.request_id, len(dst))
                t._fail(TransferError(f"bad kv_transfer_params: {err}"))
            self.transfers[req.request_id] = (t, req)

    def release_remote(self, rk: RemoteKV) -> None:
        """Tell the holder we will not pull (the request ended on its first token): an
        empty pull ends the lease at once instead of after its TTL."""
        try:
            self.transport.pull(Endpoint.from_dict(rk.peer), rk.lease_id, [], [],
                                self.timeout_s)
        except (ValueError, KeyError, TypeError) as err:
            log.warning("could not release lease %s: %s", rk.lease_id, err)

    def poll(self) -> list[Request]:
        """Advance leases and pulls; returns requests ended by a failed pull (policy fail)."""
        sched = self.scheduler
        for rid, _reason in self.transport.released():
            sched.release_held(rid)
        failed = []
        for rid, (t, req) in list(self.transfers.items()):
            if not t.is_finished:
                continue
            del self.transfers[rid]
            self.stats.transfers += 1
            if t.finished is not None:
                self.stats.seconds.append(t.finished - t.started)
                req.kv_transfer_time = t.finished - t.started
            if rid in sched.zombies:
                sched.reap(rid)
                continue
            if t.state == TransferState.DONE:
                self.stats.bytes += t.bytes
                sched.finish_remote(req, True)
                continue
            self.stats.failures += 1
            log.warning("pulling the KV of %s failed (%s); policy %s", rid, t.error,
                        self.failure_policy)
            if self.failure_policy == "recompute":
                self.stats.fallback(fallback_reason(t.error))
                sched.finish_remote(req, False)
            else:
                req.stop_reason = f"KV transfer failed: {t.error}"
                sched.fail_remote(req)
                failed.append(req)
        return failed

    def close(self) -> None:
        self.transport.close()


def fallback_reason(error: TransferError | None) -> str:
    """The `baton:fallbacks_total` reason of a failed pull."""
    for kind, reason in ((TransferTimeoutError, "transfer_timeout"),
                         (PeerUnreachableError, "kv_peer_lost"),
                         (LeaseExpiredError, "lease_expired")):
        if isinstance(error, kind):
            return reason
    return "transfer_failed"
