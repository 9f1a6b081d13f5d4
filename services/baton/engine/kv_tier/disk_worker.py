"""`DiskWorker`: the disk tier's file I/O on one background thread, so no step waits on a
disk.

The engine thread hands it spills (a host block the host pool evicts, copied out first:
its host block is reused at once) and reads (a disk block into a host block the host pool
reserved for it), and collects finished reads with `take_done()` at the next step. Reads go
first (a request waits on them); spills queue behind, at most `max_queued_spills` of them
(128 MiB of blocks unless told: the copies they hold bound the memory): past that a spill is dropped and counted, its block
lost to the tier as if evicted. A read of a block whose spill is still queued is served from
that spill's copy, so a read never misses a write issued before it.

`close()` lets the queued spills finish (reads still queued are reported failed) and stops
the thread; one that does not stop within its timeout (a hung disk) is left behind as a
daemon and its queued spills are dropped.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch

from baton.engine.kv_tier.disk_pool import DiskKVPool

log = logging.getLogger(__name__)

# Bytes of spills queued at most: each holds a copy of its block (a bf16 block of the
# bundled model is 368 KiB: 355 blocks; of a Llama-3-8B, 2 MiB: 64), and a full queue means
# the disk is slower than the evictions.
MAX_QUEUED_SPILL_BYTES = 128 << 20
CLOSE_TIMEOUT_S = 30.0


class DiskWorker:
    def __init__(self, disk: DiskKVPool, max_queued_spills: int | None = None) -> None:
        """Starts the thread. `max_queued_spills` (None: `MAX_QUEUED_SPILL_BYTES` of
        blocks, at least one). Raises ValueError for `max_queued_spills` < 1."""
        if max_queued_spills is None:
            max_queued_spills = max(1, MAX_QUEUED_SPILL_BYTES // disk.block_bytes)
        if max_queued_spills < 1:
            raise ValueError(f"max_queued_spills must be >= 1, got {max_queued_spills}")
        self.disk = disk
        self.max_queued_spills = max_queued_spills
        self.spills_dropped = 0  # full queue, write error, or left at a stop
        self._cond = threading.Condition()
        self._reads: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
        self._spills: collections.deque[int] = collections.deque()  # hashes, oldest first
        self._copies: dict[int, torch.Tensor] = {}  # queued or in-flight spills' blocks
        self._done: collections.deque[tuple[int, bool]] = collections.deque()
        self._lost: collections.deque[int] = collections.deque()  # spills that never landed
        self._busy = self._stopping = False
        self._thread = threading.Thread(target=self._run, name="baton-kv-disk", daemon=True)
        self._thread.start()

    # -- the engine thread -----------------------------------------------------------------
    def spill(self, block_hash: int, block: torch.Tensor) -> bool:
        """Queue `block` (a host block, its device copies landed) to be written under
        `block_hash`; it is copied now. False, nothing queued: the queue is full or the
        worker stopped (counted in `spills_dropped`)."""
        with self._cond:
            if block_hash in self._copies:
                return True
            if self._stopping or len(self._spills) >= self.max_queued_spills:
                self.spills_dropped += 1
                return False
        copy = block.clone()  # the host block is reused as soon as this returns
        with self._cond:
            self._copies[block_hash] = copy
            self._spills.append(block_hash)
            self._cond.notify()
        return True

    def read(self, block_hash: int, out: torch.Tensor) -> None:
        """Queue a read of `block_hash` into `out` (a host block nobody touches until
        `take_done()` reports it; at once, failed, once the worker is stopping)."""
        with self._cond:
            if self._stopping:
                self._done.append((block_hash, False))
                return
            self._reads.append((block_hash, out))
            self._cond.notify()

    def holds(self, block_hash: int) -> bool:
        """A spill of `block_hash` is queued or being written."""
        with self._cond:
            return block_hash in self._copies

    def queued(self) -> list[int]:
        """The hashes of the spills queued or being written (a snapshot, any thread)."""
        with self._cond:
            return list(self._copies)

    def take_done(self) -> list[tuple[int, bool]]:
        """Reads finished since the last call: (hash, True: `out` holds the block, its
        digest checked; False: missing or damaged, `out` undefined)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def take_lost(self) -> list[int]:
        """Hashes whose spill was accepted but never written (a write error, a stop)."""
        out = []
        while self._lost:
            out.append(self._lost.popleft())
        return out

    @property
    def depth(self) -> int:
        """Reads and spills queued or in progress."""
        with self._cond:
            return len(self._reads) + len(self._spills) + self._busy

    @property
    def running(self) -> bool:
        """Taking spills and reads (not closed)."""
        return self._thread.is_alive() and not self._stopping

    @property
    def stopped(self) -> bool:
        """The thread has ended."""
        return not self._thread.is_alive()

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued or in progress; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._reads or self._spills or self._busy), timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Finish the queued spills and stop the thread (reads still queued end failed).
        False: it did not stop within `timeout`; its queued spills are dropped."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            return True
        with self._cond:
            left = list(self._spills)
            self._spills.clear()
            for block_hash in left:
                self._copies.pop(block_hash, None)
            self.spills_dropped += len(left)
            self._lost.extend(left)
        log.warning("the KV disk tier's worker did not stop within %.0f s; %d queued spills "
                    "dropped", timeout, len(left))
        return False

    # -- the worker thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._reads or self._spills or self._stopping)
                if self._stopping:
                    self._done.extend((h, False) for h, _ in self._reads)
                    self._reads.clear()
                if not self._spills and not self._reads:
                    self._cond.notify_all()
                    return
                read = self._reads.popleft() if self._reads else None
                block_hash = read[0] if read is not None else self._spills.popleft()
                self._busy = True
            if read is not None:
                self._read(*read)
            else:
                self._write(block_hash)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _read(self, block_hash: int, out: torch.Tensor) -> None:
        with self._cond:
            queued = self._copies.get(block_hash)
        try:
            if queued is not None:
                out.copy_(queued)
                ok = True
            else:
                ok = self.disk.read(block_hash, out)
        except Exception:  # noqa: BLE001 - a read that raises fails; its load recomputes
            log.exception("reading KV block %016x from the disk tier failed", block_hash)
            ok = False
        self._done.append((block_hash, ok))

    def _write(self, block_hash: int) -> None:
        with self._cond:
            copy = self._copies[block_hash]
        try:
            self.disk.store(block_hash, copy)
        except Exception:  # noqa: BLE001 - a full or failing disk loses the block, no more
            log.exception("writing KV block %016x to the disk tier failed", block_hash)
            with self._cond:
                self.spills_dropped += 1
            self._lost.append(block_hash)
        with self._cond:
            self._copies.pop(block_hash, None)
