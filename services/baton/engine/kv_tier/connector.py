"""`TierConnector`: the host offload tier (and the disk tier under it) behind the engine's KV
connector seam.

Offload: the device pool tells the tier of each prefix-cached block it hands out again
(`KVCacheManager.on_evict`, nobody referencing it, its KV intact until the next forward);
the tier copies it into its `HostKVPool` at once, so the copy is issued before that forward
writes the block. A step issues at most `max_offloads_per_step` such copies (the step's
offload queue; past it an evicted block is dropped, counted in `offload_skipped`). A block
the host pool evicts in turn goes to the disk tier's worker thread (`DiskWorker`).

Load: a waiting request whose prompt continues, past its device prefix hits, with blocks the
tiers hold is admitted like a P/D pull: `num_remote_tokens` counts those blocks' tokens (at
least one prompt token left to compute), the scheduler allocates device blocks for them, and
`start_load` hands them to `TierLoads`, which issues the disk reads on the worker. Each
`poll()` (a step's start) takes the reads that landed and copies what the host pool holds,
at most `max_loads_per_step` blocks a step; a request all of whose blocks are copied is
reported loaded: it joins the running batch with them computed, they are published as
ordinary prefix-cached blocks, and prefill computes the rest. Those tokens count as cached
in its usage (`loads_locally`). A load one of whose reads failed (a damaged or vanished
file) is reported for `recompute`, the P/D pull's fallback: the request waits first in line
and, admitted again, loads what the tiers still hold and computes the rest.

Routing: the host pool reports each block joining or leaving it or the disk pool under it,
and the pool's event queue publishes them tagged with the tier (`KVCacheManager.tier_event`),
so a router weighs where a pod holds a prompt's blocks (`router.prefix`).

P/D: the tier wraps the engine's transport connector (`inner`), if any. A request the inner
connector loads (a `PullKV`, or a peer's `PullPrefix`) is its alone; every other hook is
passed on, so leases, pulls and their failure policies work as without a tier.
"""

from __future__ import annotations

import logging

from baton.common.internal import KVTransferParams
from baton.common.stats import KVTierStats, KVTransferStats
from baton.engine.config import LiveKVSettings
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.base import KVConnector, KVConnectorStats, KVUpdates
from baton.engine.kv_tier.host_pool import HostKVPool
from baton.engine.kv_tier.loads import MAX_LOADS_PER_STEP, TierLoads
from baton.engine.request import Request

log = logging.getLogger(__name__)

# Offload copies one step may issue: bounds the time a step's evictions add (a bf16 block of
# the bundled model is 368 KiB: 256 blocks ~ 94 MiB, tens of ms on a CPU).
MAX_OFFLOADS_PER_STEP = 256


class TierConnector(KVConnector):
    def __init__(self, kv: KVCacheManager, host: HostKVPool, inner: KVConnector | None = None,
                 max_offloads_per_step: int = MAX_OFFLOADS_PER_STEP,
                 max_loads_per_step: int = MAX_LOADS_PER_STEP) -> None:
        """Listens to `kv`'s evictions from now on."""
        self.kv, self.host, self.inner = kv, host, inner
        self.block_size = kv.block_size
        self.max_offloads_per_step = max_offloads_per_step
        self.loads = TierLoads(host, max_loads_per_step)
        self.stats = inner.stats if inner is not None else KVConnectorStats()
        self._counts = dict.fromkeys(("hit_blocks", "offloaded", "skipped", "fallbacks"), 0)
        self._offloads_this_step = 0
        self._last_step_offloads = 0
        # This schedule()'s tier loads not started yet: request id -> the blocks' hashes
        self._planned: dict[str, list[int]] = {}
        self._failed: set[str] = set()  # requests whose tier load failed: no disk reads
        kv.on_evict(self._offload, host.hashes)
        host.on_change(kv.tier_event)  # the pod publishes each tier's blocks

    # -- offload ---------------------------------------------------------------------------
    def _offload(self, block_id: int, block_hash: int) -> None:
        if block_hash in self.host:
            self.host.touch(block_hash)
        elif self._offloads_this_step >= self.max_offloads_per_step:
            self._counts["skipped"] += 1
        elif self.host.store(block_hash, block_id, self.loads.pinned):
            self._offloads_this_step += 1
            self._counts["offloaded"] += 1

    # -- admission -------------------------------------------------------------------------
    def num_remote_tokens(self, req: Request, num_cached: int) -> int:
        if self.inner is not None:
            remote = self.inner.num_remote_tokens(req, num_cached)
            if remote:
                return remote
        self._unplan(req.request_id)
        hashes = self._tier_hits(req, num_cached)
        if not hashes:
            return 0
        for block_hash in hashes:  # most recently used: this step's offloads evict others
            if block_hash in self.host:
                self.host.touch(block_hash)
        self.loads.pin(hashes)
        self._planned[req.request_id] = hashes
        return len(hashes) * self.block_size

    def _tier_hits(self, req: Request, num_cached: int) -> list[int]:
        """The hashes of the blocks after the device hits that the tiers hold, in a row,
        leaving at least one known token to compute (`get_computed_blocks`' rule); a disk
        block counts while the host pool has room to read it into."""
        if not self.kv.enable_caching or req.skips_prefix_cache:
            return []
        first = num_cached // self.block_size
        last = min((req.num_tokens - 1) // self.block_size, len(req.block_hashes))
        pinned = self.loads.pinned
        # Host blocks the reads may take: each disk hit takes one, each host hit pinned now
        # leaves one fewer to evict. A request whose load failed reads nothing this time.
        may_read = req.request_id not in self._failed
        room = self.host.room_for_reads(pinned)
        hits: list[int] = []
        for block_hash in req.block_hashes[first:last]:
            if block_hash in self.host:
                need = int(may_read and block_hash not in pinned)
            elif may_read and self.host.reading(block_hash):
                need = 0
            elif may_read and self.host.on_disk(block_hash):
                need = 1
            else:
                break
            if need > room:
                break
            room -= need
            hits.append(block_hash)
        return hits

    def _unplan(self, request_id: str) -> None:
        hashes = self._planned.pop(request_id, None)
        if hashes is not None:
            self.loads.unpin(hashes)

    def loads_locally(self, req: Request) -> bool:
        return req.request_id in self._planned or (
            self.inner is not None and self.inner.loads_locally(req))

    def start_load(self, req: Request, block_ids: list[int], num_cached: int) -> None:
        hashes = self._planned.pop(req.request_id, None)
        if hashes is None:
            assert self.inner is not None  # only the inner connector counts other loads
            self.inner.start_load(req, block_ids, num_cached)
            return
        first = num_cached // self.block_size
        self.loads.start(req, hashes, block_ids[first:first + len(hashes)])
        self.loads.unpin(hashes)  # the plan's pins: the load holds its own

    @property
    def num_loading(self) -> int:
        return len(self.loads) + (self.inner.num_loading if self.inner is not None else 0)

    # -- every step ------------------------------------------------------------------------
    def poll(self) -> KVUpdates:
        """A new step begins: the disk reads that landed join the host pool, the loads copy
        what it holds (within the step's bound), and a new step's offload bound starts."""
        updates = self.inner.poll() if self.inner is not None else KVUpdates()
        self.host.finish_io()
        done, failed = self.loads.advance()
        for load in done:
            self._counts["hit_blocks"] += load.num_blocks
            updates.loaded.append(load.req)
        for load in failed:
            log.warning("loading %d KV blocks of %s from the offload tier failed (a disk "
                        "block missing or damaged); it computes them", load.num_blocks,
                        load.req.request_id)
            self._counts["fallbacks"] += 1
            self._failed.add(load.req.request_id)
            updates.recompute.append(load.req)
        for rid in list(self._planned):
            self._unplan(rid)
        self._last_step_offloads, self._offloads_this_step = self._offloads_this_step, 0
        return updates

    @property
    def has_pending(self) -> bool:
        return bool(self.loads) or (self.inner is not None and self.inner.has_pending)

    # -- the end of a request --------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        self._unplan(req.request_id)
        self._failed.discard(req.request_id)
        if self.loads.end(req.request_id) is not None:
            return False, None  # its copies are issued: later writes of its blocks follow
        if self.inner is not None:
            return self.inner.request_finished(req, block_ids)
        return False, None

    # -- operations ------------------------------------------------------------------------
    def reconfigure(self, live: LiveKVSettings) -> None:
        if self.inner is not None:
            self.inner.reconfigure(live)

    def take_transfer_durations(self) -> list[float]:
        return self.inner.take_transfer_durations() if self.inner is not None else []

    @property
    def num_leases_held(self) -> int:
        return self.inner.num_leases_held if self.inner is not None else 0

    def release_lease(self, lease_id: str) -> bool:
        return self.inner is not None and self.inner.release_lease(lease_id)

    def kv_stats(self) -> KVTransferStats | None:
        return self.inner.kv_stats() if self.inner is not None else None

    def tier_stats(self) -> KVTierStats:
        c, host, block = self._counts, self.host, self.host.block_bytes
        io = host.io
        return KVTierStats(
            disk_read_blocks_total=host.disk_hits,
            disk_written_blocks_total=host.disk.written if host.disk is not None else 0,
            disk_blocks_held=len(host.disk) if host.disk is not None else 0,
            disk_queue_depth=io.depth if io is not None else 0,
            disk_spills_dropped_total=io.spills_dropped if io is not None else 0,
            disk_read_failures_total=host.disk_read_failures,
            load_fallbacks_total=c["fallbacks"], load_queue_blocks=self.loads.blocks_waiting,
            hit_blocks_total=c["hit_blocks"], hit_tokens_total=c["hit_blocks"] * self.block_size,
            offloaded_bytes_total=c["offloaded"] * block,
            loaded_bytes_total=self.loads.copied * block,
            offload_skipped_total=c["skipped"], blocks_held=len(host),
            blocks_total=host.num_blocks, offload_queue_depth=self._last_step_offloads)

    def close(self) -> None:
        """With a disk pool: stop its worker (queued spills written first), then write
        every block the device and host pools hold to it (a restart finds them). Then stop
        the inner connector."""
        if self.host.disk is not None:
            if self.host.close():
                try:
                    for block_id, block_hash in self.kv.cached_blocks():
                        self.host.store(block_hash, block_id)
                    self.host.flush()
                except OSError as err:
                    log.warning("writing the KV tiers to disk at this stop failed: %s", err)
            else:
                log.warning("the KV disk tier's writes did not finish: the device and host "
                            "tiers' blocks are not written at this stop")
        if self.inner is not None:
            self.inner.close()
