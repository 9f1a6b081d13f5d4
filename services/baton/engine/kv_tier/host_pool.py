"""`HostKVPool`: KV blocks kept in host memory, found by their chained block hash, least
recently used evicted first.

The blocks live in one host tensor, block first, (host blocks, layers, K/V, block_size, KVH,
D), so each host block is contiguous (a copy needs no host-side staging); pinned when the
device cache is on CUDA. Every copy is a `copy_` between a device block and a host block, issued without waiting
(`non_blocking`): on CUDA it runs in order on the current stream, before the forward that
overwrites the device block and before any later load of the host block, so nothing here
reads device memory from the host or waits on the device. On CPU the copies are plain
memcpys.

With a `DiskKVPool` under it, a block the pool evicts is written there first (on CUDA after
its offload copy's event: the host reads only host memory whose copy has landed), `promote`
reads a disk block back into a host block, and `flush` writes every held block (a graceful
stop, so a restart finds them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

import torch

from baton.engine.kv_tier.disk_pool import DiskKVPool


class HostKVPool:
    def __init__(self, device_cache: torch.Tensor, num_blocks: int,
                 host_device: torch.device | str = "cpu", disk: DiskKVPool | None = None
                 ) -> None:
        """`device_cache`: the engine's KV cache, (layers, K/V, blocks, block_size, KVH, D).
        `host_device`: where the host blocks live (cpu; meta in the tests of the device
        path). Raises ValueError for `num_blocks` < 1."""
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
        self.disk = disk
        self.disk_hits = 0
        # CUDA: each host block's offload copy, recorded on the stream that issued it
        self._landed: dict[int, torch.cuda.Event] = {}
        self._on_drop: Callable[[int], None] | None = None

    def on_drop(self, listener: Callable[[int], None]) -> None:
        """Call `listener(block_hash)` when a block leaves this pool for good (evicted
        without a disk pool to take it)."""
        self._on_drop = listener

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
        slot = self._free.pop() if self._free else self._evict_one(keep)
        if slot is None:
            return False
        self.cache[slot].copy_(self.device_cache[:, :, block_id], non_blocking=True)
        if self.disk is not None and self.device_cache.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._landed[slot] = event
        self._slots[block_hash] = slot
        return True

    def promote(self, block_hash: int, keep: Collection[int] = ()) -> bool:
        """Read `block_hash` from the disk pool into a host block (making room as `store`
        does). False: no disk pool, not there, unreadable, or no room."""
        if self.disk is None or block_hash not in self.disk:
            return False
        slot = self._free.pop() if self._free else self._evict_one(keep)
        if slot is None:
            return False
        self._landed.pop(slot, None)
        if not self.disk.read(block_hash, self.cache[slot]):
            self._free.append(slot)
            return False
        self._slots[block_hash] = slot
        self.disk_hits += 1
        return True

    def flush(self) -> None:
        """Write every held block to the disk pool (no-op without one)."""
        if self.disk is not None:
            for block_hash, slot in list(self._slots.items()):
                self._spill(block_hash, slot)

    def hashes(self) -> list[int]:
        """Every hash held here or on the disk pool (a snapshot, any thread)."""
        held = list(self._slots)
        return held if self.disk is None else held + list(self.disk.hashes())

    def load(self, block_hash: int, block_id: int) -> None:
        """Copy the held block `block_hash` into device block `block_id` and touch it.
        Raises KeyError for a hash not held."""
        slot = self._slots[block_hash]
        self.device_cache[:, :, block_id].copy_(self.cache[slot], non_blocking=True)
        self.touch(block_hash)

    def _evict_one(self, keep: Collection[int]) -> int | None:
        victim = next((h for h in self._slots if h not in keep), None)
        if victim is None:
            return None
        slot = self._slots.pop(victim)
        self._spill(victim, slot)
        return slot

    def _spill(self, block_hash: int, slot: int) -> None:
        if self.disk is None:
            if self._on_drop is not None:
                self._on_drop(block_hash)
            return
        event = self._landed.pop(slot, None)
        if event is not None:
            event.synchronize()  # issued steps ago: normally landed already
        self.disk.store(block_hash, self.cache[slot])
