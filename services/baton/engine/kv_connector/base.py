"""The KV connector contract: the scheduler's only view of disaggregation.

Every hook is called by the `Scheduler` on the engine thread (the one that steps), never
concurrently. The connector never frees, allocates or publishes blocks itself: it tells
the scheduler which requests' blocks to keep and, through `poll()`, when they can go.

    admission   num_remote_tokens(req, num_cached) > 0  -> the scheduler allocates blocks
                for the whole prompt (cached ones kept) and calls start_load(req, block_ids,
                num_cached);
                the request waits in WAITING_FOR_REMOTE_KV, counted in `num_loading`
    each step   poll() -> KVUpdates: loads that finished (run it), failed (recompute it
                locally, or end it: policy), and requests whose blocks nobody needs now
    any end     request_finished(req, block_ids) -> (keep_blocks, params): a prefill held
                under a lease (params for the puller), or an aborted request whose pull is
                still writing into its blocks; its blocks come back later in `freeable`

`num_remote_tokens` may count fewer tokens than the rest of the prompt (an offload tier holds
only some of its blocks): a loaded request joins the running batch with those tokens
computed and prefills the rest; `loads_locally` says whether they count as cached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from baton.common.internal import KVTransferParams
from baton.common.stats import KVTierStats, KVTransferStats
from baton.engine.config import LiveKVSettings
from baton.engine.request import Request


@dataclass
class KVUpdates:
    """What changed since the last poll. Each request appears at most once."""

    loaded: list[Request] = field(default_factory=list)  # its prompt's KV is in place
    recompute: list[Request] = field(default_factory=list)  # load failed: prefill locally
    failed: list[tuple[Request, str]] = field(default_factory=list)  # load failed: end it
    freeable: list[Request] = field(default_factory=list)  # ended; blocks no longer needed


@dataclass
class KVConnectorStats:
    """Counters for /metrics, written on the engine thread, read anywhere."""

    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


class KVConnector(ABC):
    stats: KVConnectorStats

    # -- admission -------------------------------------------------------------------------
    @abstractmethod
    def num_remote_tokens(self, req: Request, num_cached: int) -> int:
        """Tokens of a waiting request whose KV arrives from elsewhere, right after its
        `num_cached` locally cached ones, in whole blocks unless they end the prompt; 0:
        compute them here. At least one of its known tokens is left to compute unless the
        load brings its first output (a P/D pull)."""

    @abstractmethod
    def start_load(self, req: Request, block_ids: list[int], num_cached: int) -> None:
        """Blocks for the cached and the `num_remote_tokens` tokens are allocated
        (`block_ids`; those of the `num_cached` ones already hold their KV): start filling
        the rest. Called in the same `schedule()` as the `num_remote_tokens` that counted
        them. Never blocks; a load that cannot start is reported failed by `poll()`."""

    def loads_locally(self, req: Request) -> bool:
        """True when the tokens `num_remote_tokens` just counted for `req` were computed
        on this engine before (an offload tier's copy): usage reports them as cached.
        False (the default): they come from another pod's prefill."""
        return False

    @property
    @abstractmethod
    def num_loading(self) -> int:
        """Requests in WAITING_FOR_REMOTE_KV (they count against `max_num_seqs`)."""

    # -- every step ------------------------------------------------------------------------
    @abstractmethod
    def poll(self) -> KVUpdates:
        """Advance leases and loads without blocking."""

    @property
    @abstractmethod
    def has_pending(self) -> bool:
        """Work that advances without model steps (loads, leases): keep polling."""

    # -- the end of a request --------------------------------------------------------------
    @abstractmethod
    def request_finished(self, req: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        """`req` ended (any way; its status says how). True: keep its blocks allocated
        until a later `poll()` lists it in `freeable`. The params, when not None, tell a
        puller where the blocks are (the request's final output carries them)."""

    # -- operations ------------------------------------------------------------------------
    @abstractmethod
    def reconfigure(self, live: LiveKVSettings) -> None:
        """Apply live-tuned knobs to leases and loads started from now on."""

    @abstractmethod
    def take_transfer_durations(self) -> list[float]:
        """Seconds each finished load took since the last call (thread-safe)."""

    @property
    @abstractmethod
    def num_leases_held(self) -> int:
        """Finished requests whose blocks wait for a puller."""

    def release_lease(self, lease_id: str) -> bool:
        """Holder side, any thread: nobody will pull this lease (its client left), so end
        it now; the next `poll()` reports its blocks freeable. False when this connector
        holds no such lease or its pull has begun. Connectors without leases: False."""
        return False

    def kv_stats(self) -> KVTransferStats | None:
        """The connector's transfer stats (any thread); None: it transfers nothing."""
        return KVTransferStats(bytes_total=self.stats.bytes, failures_total=self.stats.failures,
                               leases_held=self.num_leases_held,
                               fallbacks=dict(self.stats.fallbacks))

    def tier_stats(self) -> KVTierStats | None:
        """The offload tier's stats (any thread); None: no tier (the default)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stop the transport; called once, on the engine thread, when the engine stops."""
