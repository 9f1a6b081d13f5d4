"""An engine's counters and gauges, typed: what `AsyncEngine.stats()` returns, the worker's
`/metrics` collector and load report read. Plain values, read from another thread."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.common.step_timing import StepTiming


@dataclass(frozen=True)
class KVTransferStats:
    """A disaggregated engine's KV connector: pulled bytes, failed pulls, leases held, and
    requests that fell back to a local prefill, by reason."""

    bytes_total: int = 0
    failures_total: int = 0
    leases_held: int = 0
    fallbacks: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class KVTierStats:
    """The host offload tier under the KV pool (`engine.kv_tier`): prefix hits served from
    it, bytes copied each way, blocks it holds, and the offload copies of the last step
    (the queue a step's evictions fill; `offload_skipped_total` went past its bound)."""

    hit_blocks_total: int = 0
    hit_tokens_total: int = 0
    offloaded_bytes_total: int = 0
    loaded_bytes_total: int = 0
    offload_skipped_total: int = 0
    blocks_held: int = 0
    blocks_total: int = 0
    offload_queue_depth: int = 0
    disk_read_blocks_total: int = 0  # the disk pool under the host one (`--kv-disk-dir`)
    disk_written_blocks_total: int = 0
    disk_blocks_held: int = 0
    disk_queue_depth: int = 0  # the disk worker's reads and spills queued or in progress
    disk_spills_dropped_total: int = 0  # its queue was full (or the write failed)
    disk_read_failures_total: int = 0  # a block missing or damaged: its load recomputed
    load_fallbacks_total: int = 0  # loads that failed and computed their tokens instead
    load_queue_blocks: int = 0  # blocks admitted loads have still to copy (per-step bound)

    def series(self) -> dict[str, float]:
        return {"baton:kv_offload_hit_blocks_total": self.hit_blocks_total,
                "baton:kv_offload_hit_tokens_total": self.hit_tokens_total,
                "baton:kv_offload_bytes_total": self.offloaded_bytes_total,
                "baton:kv_offload_loaded_bytes_total": self.loaded_bytes_total,
                "baton:kv_offload_skipped_total": self.offload_skipped_total,
                "baton:kv_offload_blocks_held": self.blocks_held,
                "baton:kv_offload_capacity_blocks": self.blocks_total,
                "baton:kv_offload_queue_depth": self.offload_queue_depth,
                "baton:kv_offload_disk_read_blocks_total": self.disk_read_blocks_total,
                "baton:kv_offload_disk_written_blocks_total": self.disk_written_blocks_total,
                "baton:kv_offload_disk_blocks_held": self.disk_blocks_held,
                "baton:kv_offload_disk_queue_depth": self.disk_queue_depth,
                "baton:kv_offload_disk_spills_dropped_total": self.disk_spills_dropped_total,
                "baton:kv_offload_disk_read_failures_total": self.disk_read_failures_total,
                "baton:kv_offload_load_fallbacks_total": self.load_fallbacks_total,
                "baton:kv_offload_load_queue_blocks": self.load_queue_blocks}


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding (`engine.spec`): guesses proposed and accepted, the (request,
    step) pairs that verified guesses, and how often the guess at each position was
    accepted — by `method`."""

    method: str
    proposed_tokens_total: int = 0
    accepted_tokens_total: int = 0
    verifications_total: int = 0
    accepted_by_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens_total / self.proposed_tokens_total \
            if self.proposed_tokens_total else 0.0


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    preemptions_total: int = 0
    kv_transfer: KVTransferStats | None = None  # None: no KV connector
    spec: SpecStats | None = None  # None: no speculative decoding
    kv_tier: KVTierStats | None = None  # None: no host offload tier
    timing: StepTiming | None = None  # device-busy and host seconds of the steps

    @property
    def kv_cache_usage_ratio(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def leases_held(self) -> int:
        return self.kv_transfer.leases_held if self.kv_transfer is not None else 0

    def series(self) -> dict[str, float]:
        """Each `/metrics` series' value by name (common/metrics.py ENGINE_SERIES)."""
        out: dict[str, float] = {
            "baton:num_requests_running": self.running,
            "baton:num_requests_waiting": self.waiting,
            "baton:kv_blocks_used": self.kv_blocks_used,
            "baton:kv_blocks_total": self.kv_blocks_total,
            "baton:kv_cache_usage_ratio": self.kv_cache_usage_ratio,
            "baton:prompt_tokens_total": self.prompt_tokens_total,
            "baton:generation_tokens_total": self.generation_tokens_total,
            "baton:prefix_cache_hit_tokens_total": self.prefix_cache_hit_tokens_total,
            "baton:preemptions_total": self.preemptions_total,
        }
        if self.kv_transfer is not None:
            out |= {"baton:kv_transfer_bytes_total": self.kv_transfer.bytes_total,
                    "baton:kv_transfer_failures_total": self.kv_transfer.failures_total,
                    "baton:kv_leases_held": self.kv_transfer.leases_held}
        if self.kv_tier is not None:
            out |= self.kv_tier.series()
        return out
