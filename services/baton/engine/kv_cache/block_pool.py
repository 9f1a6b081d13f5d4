"""A pool of fixed-size KV blocks with reference counts and an LRU queue of free blocks.

Free blocks that still hold a full, hashed block stay findable by hash (the prefix cache)
until they are handed out again; the least recently freed go first.

Once `record_events()` is called (by a pod that publishes what it holds for prefix-aware
routing), every change to the set of findable hashes is appended to `events` as
`(stored, hash, tier)` (`stored` False for an eviction; `tier` the registry's
`DEVICE` for this pool), and `(False, None, DEVICE)` for a reset of the whole cache. The
engine thread appends; the publisher on another thread pops (a deque is safe for one
appender and one popper). The deque is bounded: a publisher that fell behind sees
`events_appended` run ahead of what it popped and resends a snapshot instead.

An eviction listener (`on_evict`, the host offload tier) hears of each cached block handed
out again while its KV is still intact: the next forward overwrites it, so the listener may
copy it away. The tiers under the pool publish their own blocks through the same queue
(`tier_event`, tagged `HOST` / `DISK`), and `held_hashes` lists them with the pool's
(`on_evict`'s `also_held`), so a router knows in which tier a pod holds each block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from baton.common.registry import DEVICE


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first. Both cached and empty ones live here.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block hash -> block
        self.events: deque[tuple[bool, int | None, str]] | None = None
        self.events_appended = 0
        self._on_evict: Callable[[int, int], None] | None = None
        self._also_held: Callable[[], list[tuple[int, str]]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` free blocks (evicting their cached contents). Raises if fewer are free:
        callers check `num_free_blocks` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; the caller passes tail blocks first so that a
        sequence's tail is evicted before its (more shareable) head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed with ref_cnt={block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Make a full block findable by its chained hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._event(True, block_hash)

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._event(False, None)

    def on_evict(self, listener: Callable[[int, int], None],
                 also_held: Callable[[], list[tuple[int, str]]] | None = None) -> None:
        """Call `listener(block_id, block_hash)` (engine thread) each time a findable block
        is taken by `allocate`: its KV stays intact until the next forward writes the
        block, so the listener may copy it away now. `also_held()` (any thread, a
        snapshot): the (hash, tier) of every block the tiers under the pool hold."""
        self._on_evict, self._also_held = listener, also_held

    def tier_event(self, tier: str, stored: bool, block_hash: int) -> None:
        """A tier under the pool (`registry.HOST`, `DISK`) took or let go `block_hash`:
        published like the pool's own changes, tagged with the tier (engine thread)."""
        self._event(stored, block_hash, tier)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self._event(False, block.block_hash)
                if self._on_evict is not None:
                    self._on_evict(block.block_id, block.block_hash)
            block.block_hash = None

    def record_events(self, capacity: int = 1 << 16) -> None:
        self.events = deque(maxlen=capacity)

    def _event(self, stored: bool, block_hash: int | None, tier: str = DEVICE) -> None:
        if self.events is not None:
            self.events.append((stored, block_hash, tier))
            self.events_appended += 1

    def cached_hashes(self) -> list[int]:
        """Every hash findable in the pool now (a snapshot; safe from another thread:
        `list` of a dict's keys runs without releasing the GIL)."""
        return list(self._cached)

    def held_hashes(self) -> list[tuple[int, str]]:
        """(hash, tier) of every block this engine serves now: the pool's (`DEVICE`) and
        the tiers' under it (a snapshot, any thread)."""
        held = [(h, DEVICE) for h in self._cached]
        return held if self._also_held is None else held + self._also_held()

    def counts(self) -> tuple[int, int, int]:
        """(empty free, cached free, used) — these always add up to `num_blocks`."""
        cached_free = sum(1 for b in self._free.values() if b.block_hash is not None)
        return len(self._free) - cached_free, cached_free, self.num_blocks - len(self._free)
