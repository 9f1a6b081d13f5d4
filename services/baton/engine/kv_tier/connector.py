"""`TierConnector`: the host offload tier behind the engine's KV connector seam.

Offload: the device pool tells the tier of each prefix-cached block it hands out again
(`KVCacheManager.on_evict`, nobody referencing it, its KV intact until the next forward);
the tier copies it into its `HostKVPool` at once, so the copy is issued before that forward
writes the block. A step issues at most `max_offloads_per_step` such copies (the step's
offload queue; past it an evicted block is dropped, counted in `offload_skipped`).

Load: a waiting request whose prompt continues, past its device prefix hits, with blocks the
tier holds is admitted like a P/D pull: `num_remote_tokens` counts those blocks' tokens (at
least one prompt token left to compute), the scheduler allocates device blocks for them,
`start_load` copies them in, and the next `poll()` reports the request loaded: it joins the
running batch with them computed, they are published as ordinary prefix-cached blocks, and
prefill computes the rest. Those tokens count as cached in its usage (`loads_locally`).

P/D: the tier wraps the engine's transport connector (`inner`), if any. A request the inner
connector loads (a `PullKV`) is its alone; every other hook is passed on, so leases, pulls
and their failure policies work as without a tier.
"""

from __future__ import annotations

from baton.common.internal import KVTransferParams
from baton.common.stats import KVTierStats, KVTransferStats
from baton.engine.config import LiveKVSettings
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.base import KVConnector, KVConnectorStats, KVUpdates
from baton.engine.kv_tier.host_pool import HostKVPool
from baton.engine.request import Request

# Offload copies one step may issue: bounds the time a step's evictions add (a bf16 block of
# the bundled model is 368 KiB: 256 blocks ~ 94 MiB, tens of ms on a CPU).
MAX_OFFLOADS_PER_STEP = 256


class TierConnector(KVConnector):
    def __init__(self, kv: KVCacheManager, host: HostKVPool, inner: KVConnector | None = None,
                 max_offloads_per_step: int = MAX_OFFLOADS_PER_STEP) -> None:
        """Listens to `kv`'s evictions from now on."""
        self.kv, self.host, self.inner = kv, host, inner
        self.block_size = kv.block_size
        self.max_offloads_per_step = max_offloads_per_step
        self.stats = inner.stats if inner is not None else KVConnectorStats()
        self._counts = dict.fromkeys(("hit_blocks", "offloaded", "loaded", "skipped"), 0)
        self._offloads_this_step = 0
        self._last_step_offloads = 0
        # This schedule()'s tier loads: request id -> (first block, hashes to load)
        self._planned: dict[str, tuple[int, list[int]]] = {}
        self._loaded: dict[str, Request] = {}  # copied in, reported by the next poll()
        kv.on_evict(self._offload, host.hashes)
        host.on_drop(self._dropped)
        if host.disk is not None:
            host.disk.on_drop(self._dropped)

    # -- offload ---------------------------------------------------------------------------
    def _offload(self, block_id: int, block_hash: int) -> bool:
        """True: the tier holds the block (the pool keeps its hash published)."""
        if block_hash in self.host:
            self.host.touch(block_hash)
            return True
        if self._offloads_this_step >= self.max_offloads_per_step:
            self._counts["skipped"] += 1
            return self._on_disk(block_hash)
        keep = {h for _, hashes in self._planned.values() for h in hashes}
        if self.host.store(block_hash, block_id, keep):
            self._offloads_this_step += 1
            self._counts["offloaded"] += 1
            return True
        return self._on_disk(block_hash)

    def _on_disk(self, block_hash: int) -> bool:
        return self.host.disk is not None and block_hash in self.host.disk

    def _dropped(self, block_hash: int) -> None:
        """A tier let `block_hash` go: unpublished unless another still holds it."""
        if block_hash not in self.host and not self._on_disk(block_hash):
            self.kv.tier_dropped(block_hash)

    # -- admission -------------------------------------------------------------------------
    def num_remote_tokens(self, req: Request, num_cached: int) -> int:
        if self.inner is not None:
            remote = self.inner.num_remote_tokens(req, num_cached)
            if remote:
                return remote
        self._planned.pop(req.request_id, None)
        hashes = self._host_hits(req, num_cached)
        if not hashes:
            return 0
        for block_hash in hashes:  # most recently used: this step's offloads evict others
            self.host.touch(block_hash)
        self._planned[req.request_id] = (num_cached // self.block_size, hashes)
        return len(hashes) * self.block_size

    def _host_hits(self, req: Request, num_cached: int) -> list[int]:
        """The hashes of the blocks after the device hits that the tier holds, in a row,
        leaving at least one known token to compute (`get_computed_blocks`' rule); blocks
        on the disk pool are read into the host pool on the way."""
        if not self.kv.enable_caching or req.skips_prefix_cache:
            return []
        first = num_cached // self.block_size
        last = min((req.num_tokens - 1) // self.block_size, len(req.block_hashes))
        hits: list[int] = []
        keep = {h for _, hashes in self._planned.values() for h in hashes}
        for block_hash in req.block_hashes[first:last]:
            if block_hash not in self.host and not self.host.promote(block_hash, keep):
                break  # neither in the host pool nor readable from the disk pool under it
            hits.append(block_hash)
            keep.add(block_hash)
        return hits

    def loads_locally(self, req: Request) -> bool:
        return req.request_id in self._planned

    def start_load(self, req: Request, block_ids: list[int]) -> None:
        plan = self._planned.pop(req.request_id, None)
        if plan is None:
            assert self.inner is not None  # only the inner connector counts other loads
            self.inner.start_load(req, block_ids)
            return
        first, hashes = plan
        for i, block_hash in enumerate(hashes):
            self.host.load(block_hash, block_ids[first + i])
        self._counts["hit_blocks"] += len(hashes)
        self._counts["loaded"] += len(hashes)
        self._loaded[req.request_id] = req

    @property
    def num_loading(self) -> int:
        return len(self._loaded) + (self.inner.num_loading if self.inner is not None else 0)

    # -- every step ------------------------------------------------------------------------
    def poll(self) -> KVUpdates:
        """A new step begins: the tier's loads are in place (their copies were issued before
        any forward reads them), and a new step's offload bound starts."""
        updates = self.inner.poll() if self.inner is not None else KVUpdates()
        updates.loaded.extend(self._loaded.values())
        self._loaded.clear()
        self._planned.clear()
        self._last_step_offloads, self._offloads_this_step = self._offloads_this_step, 0
        return updates

    @property
    def has_pending(self) -> bool:
        return bool(self._loaded) or (self.inner is not None and self.inner.has_pending)

    # -- the end of a request --------------------------------------------------------------
    def request_finished(self, req: Request, block_ids: list[int]
                         ) -> tuple[bool, KVTransferParams | None]:
        if self._loaded.pop(req.request_id, None) is not None:
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
        c, block, disk = self._counts, self.host.block_bytes, self.host.disk
        return KVTierStats(
            disk_read_blocks_total=self.host.disk_hits,
            disk_written_blocks_total=disk.written if disk is not None else 0,
            disk_blocks_held=len(disk) if disk is not None else 0,
            hit_blocks_total=c["hit_blocks"], hit_tokens_total=c["hit_blocks"] * self.block_size,
            offloaded_bytes_total=c["offloaded"] * block, loaded_bytes_total=c["loaded"] * block,
            offload_skipped_total=c["skipped"], blocks_held=len(self.host),
            blocks_total=self.host.num_blocks, offload_queue_depth=self._last_step_offloads)

    def close(self) -> None:
        """With a disk pool: write every block the device and host pools hold to it (a
        restart finds them). Then stop the inner connector."""
        if self.host.disk is not None:
            for block_id, block_hash in self.kv.cached_blocks():
                self.host.store(block_hash, block_id)
            self.host.flush()
        if self.inner is not None:
            self.inner.close()
