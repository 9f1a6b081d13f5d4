"""`TierLoads`: the offload tier's loads in flight — each admitted request's blocks still to
copy from the host pool into the device blocks the scheduler allocated for them.

A block is copied once the host pool holds it: at once for a host hit, after the worker's
read lands for a disk hit. A step copies at most `max_blocks_per_step` blocks, oldest load
first; a load whose blocks do not all fit goes on at the next step (its request stays in
WAITING_FOR_REMOTE_KV). A load is done when every block is copied, and failed when one of
its blocks is neither held nor being read (its read failed, or could not start): the
connector then has its request recompute those tokens.

While a load needs a hash it is pinned (`pinned`, a count per hash): the host pool never
evicts a pinned block to make room. Engine thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from baton.engine.kv_tier.host_pool import HostKVPool
from baton.engine.request import Request

# Blocks a step's tier loads may copy: bounds the time the loads add to a step (a bf16 block
# of the bundled model is 368 KiB: 256 blocks ~ 94 MiB, tens of ms on a CPU).
MAX_LOADS_PER_STEP = 256


@dataclass
class TierLoad:
    req: Request
    todo: list[tuple[int, int]]  # (hash, device block id) not copied yet
    num_blocks: int
    failed: bool = False  # a read could not start


class TierLoads:
    def __init__(self, host: HostKVPool, max_blocks_per_step: int = MAX_LOADS_PER_STEP
                 ) -> None:
        """Raises ValueError for `max_blocks_per_step` < 1."""
        if max_blocks_per_step < 1:
            raise ValueError(f"max_loads_per_step must be >= 1, got {max_blocks_per_step}")
        self.host = host
        self.max_blocks_per_step = max_blocks_per_step
        self.pinned: Counter[int] = Counter()
        self.copied = 0  # blocks copied since start
        self._loads: dict[str, TierLoad] = {}  # oldest first

    def __len__(self) -> int:
        return len(self._loads)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._loads

    @property
    def blocks_waiting(self) -> int:
        """Blocks the loads in flight have still to copy."""
        return sum(len(load.todo) for load in self._loads.values())

    def pin(self, hashes: Iterable[int]) -> None:
        self.pinned.update(hashes)

    def unpin(self, hashes: Iterable[int]) -> None:
        for block_hash in hashes:
            self.pinned[block_hash] -= 1
            if self.pinned[block_hash] <= 0:
                del self.pinned[block_hash]

    def start(self, req: Request, hashes: list[int], block_ids: list[int]) -> None:
        """Load `hashes` into `block_ids` (same length), reading from disk those the host
        pool does not hold and is not reading already."""
        load = TierLoad(req, list(zip(hashes, block_ids)), len(hashes))
        self.pin(hashes)
        for block_hash in hashes:
            if (block_hash not in self.host and not self.host.reading(block_hash)
                    and not self.host.start_read(block_hash, self.pinned)):
                load.failed = True
                break
        self._loads[req.request_id] = load

    def end(self, request_id: str) -> TierLoad | None:
        """Forget a load (its request ended, or it was reported); None: no such load."""
        load = self._loads.pop(request_id, None)
        if load is not None:
            self.unpin(h for h, _ in load.todo)
        return load

    def advance(self) -> tuple[list[TierLoad], list[TierLoad]]:
        """Copy what the host pool holds, up to the step's bound, oldest load first.
        Returns the loads done and the loads failed, both forgotten."""
        budget = self.max_blocks_per_step
        done: list[TierLoad] = []
        failed: list[TierLoad] = []
        for rid, load in list(self._loads.items()):
            if load.failed or any(h not in self.host and not self.host.reading(h)
                                  for h, _ in load.todo):
                failed.append(load)
                self.end(rid)
                continue
            budget = self._copy(load, budget)
            if not load.todo:
                done.append(load)
                self.end(rid)
        return done, failed

    def _copy(self, load: TierLoad, budget: int) -> int:
        rest = []
        for block_hash, block_id in load.todo:
            if budget > 0 and block_hash in self.host:
                self.host.load(block_hash, block_id)
                self.unpin((block_hash,))
                budget -= 1
                self.copied += 1
            else:
                rest.append((block_hash, block_id))
        load.todo = rest
        return budget
