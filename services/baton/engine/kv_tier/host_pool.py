"""`HostKVPool`: KV blocks kept in host memory, found by their chained block hash, least
recently used evicted first.

The blocks live in one host tensor, block first, (host blocks, layers, K/V, block_size, KVH,
D), so each host block is contiguous (a copy needs no host-side staging); pinned when the
device cache is on CUDA. Every device copy is a `copy_` between a device block and a host
block, issued without waiting (`non_blocking`): on CUDA it runs in order on the current
stream, before the forward that overwrites the device block and before any later load of
the host block, so nothing here reads device memory from the host or waits on the device.
On CPU the copies are plain memcpys.

With a `DiskKVPool` under it, its file I/O runs on a `DiskWorker` thread: a block the pool
evicts is handed to the worker to be written (`spill`), and a disk block a load needs is
read into a host block reserved for it (`start_read`), which joins the pool when the worker
reports it (`finish_io`, at a step's start). On CUDA the host touches a host block only
once the device copies that last used it have landed (each records an event). `close` stops
the worker; `flush` then writes every held block (a graceful stop, so a restart finds
them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

import torch

from baton.common.registry import DISK, HOST
from baton.engine.kv_tier.disk_pool import DiskKVPool
from baton.engine.kv_tier.disk_worker import DiskWorker


class HostKVPool:
    def __init__(self, device_cache: torch.Tensor, num_blocks: int,
                 host_device: torch.device | str = "cpu", disk: DiskKVPool | None = None,
                 max_queued_spills: int | None = None) -> None:
        """`device_cache`: the engine's KV cache, (layers, K/V, blocks, block_size, KVH, D).
        `host_device`: where the host blocks live (cpu; meta in the tests of the device
        path). With `disk`, starts its worker thread. Raises ValueError for `num_blocks`
        < 1."""
        if num_blocks < 1:
            raise ValueError(f"HostKVPool needs at least one block, got {num_blocks}")
        layers, kv, _, block_size, heads, dim = device_cache.shape
        pin = device_cache.device.type == "cuda" and torch.device(host_device).type == "cpu"
        self.cache = torch.empty(num_blocks, layers, kv, block_size, heads, dim,
                                 dtype=device_cache.dtype, device=host_device,
                                 pin_memory=pin)  # (host blocks, L, 2, bs, KVH, D)
        self.device_cache = device_cache
        self.num_blocks = num_blocks
        self.block_bytes = self.cache[0].numel() * self.cache.element_size()
        self._slots: OrderedDict[int, int] = OrderedDict()  # hash -> host block, LRU first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._reading: dict[int, int] = {}  # hash -> host block its disk read fills
        self.disk = disk
        self.io = DiskWorker(disk, max_queued_spills) if disk is not None else None
        self.disk_hits = self.disk_read_failures = 0
        # CUDA with a disk: each host block's last device copy, on the stream that issued it
        self._landed: dict[int, torch.cuda.Event] = {}
        self._on_change: Callable[[str, bool, int], None] | None = None

    def on_change(self, listener: Callable[[str, bool, int], None]) -> None:
        """Call `listener(tier, stored, block_hash)` (engine thread) when a block joins
        (`stored`) or leaves this pool (tier `HOST`) or the disk pool under it (`DISK`; a
        block counts as there once its spill is queued): what the pod publishes."""
        self._on_change = listener

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._slots)

    def touch(self, block_hash: int) -> None:
        """Mark a held block most recently used."""
        self._slots.move_to_end(block_hash)

    def store(self, block_hash: int, block_id: int, keep: Collection[int] = ()) -> bool:
        """Copy device block `block_id` in under `block_hash` (a held hash is only touched:
        equal hashes mean equal KV). When full, the least recently used block not in
        `keep` makes room. False, nothing copied: every held block is in `keep`."""
        if block_hash in self._slots:
            self.touch(block_hash)
            return False
        slot = self._take_slot(keep)
        if slot is None:
            return False
        self.cache[slot].copy_(self.device_cache[:, :, block_id], non_blocking=True)
        self._record(slot)
        self._slots[block_hash] = slot
        self._tell(HOST, True, block_hash)
        return True

    def load(self, block_hash: int, block_id: int) -> None:
        """Copy the held block `block_hash` into device block `block_id` and touch it.
        Raises KeyError for a hash not held."""
        slot = self._slots[block_hash]
        self.device_cache[:, :, block_id].copy_(self.cache[slot], non_blocking=True)
        self._record(slot)
        self.touch(block_hash)

    def hashes(self) -> list[tuple[int, str]]:
        """(hash, tier) of every block held here (`HOST`) or on the disk pool, or on its way
        there (`DISK`): a snapshot, any thread."""
        held = [(h, HOST) for h in list(self._slots)]
        if self.io is None:
            return held
        return held + [(h, DISK) for h in self.io.disk.hashes() + self.io.queued()]

    # -- the disk pool under it ------------------------------------------------------------
    def on_disk(self, block_hash: int) -> bool:
        """The disk pool holds `block_hash`, or will once its queued spill is written."""
        return self.io is not None and (block_hash in self.io.disk or self.io.holds(block_hash))

    def reading(self, block_hash: int) -> bool:
        """A disk read of `block_hash` is in flight."""
        return block_hash in self._reading

    def room_for_reads(self, keep: Collection[int]) -> int:
        """Disk reads `start_read` can still find a host block for while `keep` stays."""
        return self.num_blocks - len(self._reading) - sum(h in self._slots for h in keep)

    def start_read(self, block_hash: int, keep: Collection[int] = ()) -> bool:
        """Reserve a host block (making room as `store` does) and have the worker read
        `block_hash` from disk into it. False, nothing started: no disk pool, not there,
        or no room."""
        if self.io is None or not self.on_disk(block_hash):
            return False
        slot = self._take_slot(keep)
        if slot is None:
            return False
        self._reading[block_hash] = slot
        self.io.read(block_hash, self.cache[slot])
        return True

    def finish_io(self) -> list[int]:
        """Engine thread, at a step's start: what the worker did since — blocks that left
        the disk pool (size bound, damage) or never reached it are published gone, the
        reads it finished join this pool (most recently used), a failed read's host block
        is freed. Returns the failed reads' hashes."""
        if self.io is None:
            return []
        for block_hash in self.io.disk.take_dropped() + self.io.take_lost():
            if not self.on_disk(block_hash):  # (a later spill may have queued it again)
                self._tell(DISK, False, block_hash)
        failed = []
        for block_hash, ok in self.io.take_done():
            slot = self._reading.pop(block_hash)
            if ok and block_hash in self._slots:  # offloaded again meanwhile: same KV
                self._free.append(slot)
            elif ok:
                self._slots[block_hash] = slot
                self.disk_hits += 1
                self._tell(HOST, True, block_hash)
            else:
                self._free.append(slot)
                self.disk_read_failures += 1
                failed.append(block_hash)
        return failed

    def close(self) -> bool:
        """Stop the disk worker once its queued spills are written; later spills are
        written on the calling thread. False: it did not stop in time (a hung disk)."""
        return self.io is None or self.io.close()

    def flush(self) -> None:
        """Write every held block to the disk pool, on the calling thread (after `close`;
        no-op without a disk pool)."""
        if self.io is not None:
            for block_hash, slot in list(self._slots.items()):
                self._spill(block_hash, slot)

    # -- internals -------------------------------------------------------------------------
    def _take_slot(self, keep: Collection[int]) -> int | None:
        """A free host block, or the least recently used one not in `keep` (spilled to the
        disk pool); None: every held block is in `keep`."""
        if self._free:
            return self._free.pop()
        victim = next((h for h in self._slots if h not in keep), None)
        if victim is None:
            return None
        slot = self._slots.pop(victim)
        self._tell(HOST, False, victim)
        self._spill(victim, slot)
        return slot

    def _spill(self, block_hash: int, slot: int) -> None:
        if self.io is None:
            return
        self._settle(slot)
        if not self.io.running:  # stopped: a graceful stop writes here
            self.io.disk.store(block_hash, self.cache[slot])
        elif block_hash in self.io.disk:
            self.io.disk.touch(block_hash)
        elif self.io.spill(block_hash, self.cache[slot]):
            self._tell(DISK, True, block_hash)

    def _tell(self, tier: str, stored: bool, block_hash: int) -> None:
        if self._on_change is not None:
            self._on_change(tier, stored, block_hash)

    def _record(self, slot: int) -> None:
        if self.disk is not None and self.device_cache.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._landed[slot] = event

    def _settle(self, slot: int) -> None:
        """The host is about to touch host block `slot`: wait for its last device copy
        (issued steps ago: normally landed already)."""
        event = self._landed.pop(slot, None)
        if event is not None:
            event.synchronize()
