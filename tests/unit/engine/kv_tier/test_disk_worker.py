"""The disk tier's worker thread: spills and reads run off the caller's thread, a full queue
drops spills and counts them, a read of a block whose spill is still queued finds it, reads
go before queued spills, and `close` writes the queued spills and stops the thread — or,
over a disk that hangs, gives up after its timeout and drops them."""

from __future__ import annotations

import threading
import time

import torch

from baton.engine.kv_tier import DiskKVPool
from baton.engine.kv_tier.disk_worker import DiskWorker
from tests.unit.engine.kv_tier.test_disk_pool import BYTES, SHAPE, block


class GatedDisk(DiskKVPool):
    """A real disk pool whose I/O waits for `gate` (a slow or hung disk) and records the
    order it ran in."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.gate = threading.Event()
        self.entered = threading.Event()  # the thread has begun an I/O
        self.order: list[tuple[str, int]] = []

    def store(self, block_hash: int, data: torch.Tensor) -> None:
        self.entered.set()
        self.gate.wait()
        self.order.append(("store", block_hash))
        super().store(block_hash, data)

    def read(self, block_hash: int, out: torch.Tensor) -> bool:
        self.entered.set()
        self.gate.wait()
        self.order.append(("read", block_hash))
        return super().read(block_hash, out)


def test_a_full_queue_drops_spills_and_counts_them(tmp_path):
    disk = GatedDisk(tmp_path, "fp", BYTES, 16)
    worker = DiskWorker(disk, max_queued_spills=2)
    assert worker.spill(1, block(1.0))  # taken by the thread, waits at the gate
    assert disk.entered.wait(10)
    assert worker.spill(2, block(2.0)) and worker.spill(3, block(3.0))  # the queue: 2
    assert not worker.spill(4, block(4.0)) and worker.spills_dropped == 1
    assert worker.depth == 3 and worker.holds(3) and not worker.holds(4)
    disk.gate.set()
    assert worker.wait_idle(10) and worker.depth == 0
    assert sorted(disk.hashes()) == [1, 2, 3] and worker.take_lost() == []
    assert worker.close()


def test_a_read_finds_a_queued_spill_and_goes_before_queued_spills(tmp_path):
    disk = GatedDisk(tmp_path, "fp", BYTES, 16)
    disk.gate.set()
    disk.store(5, block(5.0))
    disk.gate.clear()
    disk.entered.clear()
    disk.order.clear()
    worker = DiskWorker(disk)
    assert worker.spill(7, block(7.0)) and disk.entered.wait(10)  # writing 7, at the gate
    src = block(8.0)
    worker.spill(8, src)  # queued behind it
    src.fill_(0.0)  # the spill copied its block: the caller may reuse it at once
    out8, out5 = torch.zeros(SHAPE), torch.zeros(SHAPE)
    worker.read(8, out8)
    worker.read(5, out5)
    disk.gate.set()
    assert worker.wait_idle(10)
    assert worker.take_done() == [(8, True), (5, True)]
    assert torch.equal(out8, block(8.0)) and torch.equal(out5, block(5.0))
    # the reads ran before the queued spill of 8, the one of 8 from that spill's copy
    assert disk.order == [("store", 7), ("read", 5), ("store", 8)]
    assert worker.close()


def test_close_writes_queued_spills_and_stops_the_thread(tmp_path):
    disk = GatedDisk(tmp_path, "fp", BYTES, 16)
    worker = DiskWorker(disk)
    for h in (1, 2, 3):
        worker.spill(h, block(float(h)))
    out = torch.zeros(SHAPE)
    releaser = threading.Timer(0.2, disk.gate.set)
    releaser.start()
    assert worker.close(timeout=10)
    assert worker.stopped and sorted(disk.hashes()) == [1, 2, 3]
    assert not worker.spill(4, block(4.0))  # stopped: nothing more queued
    worker.read(9, out)  # a stopped worker fails a read at once: nothing waits on it
    assert worker.take_done() == [(9, False)]


def test_close_over_a_hung_disk_gives_up_and_drops_the_queue(tmp_path):
    disk = GatedDisk(tmp_path, "fp", BYTES, 16)
    worker = DiskWorker(disk)
    for h in (1, 2, 3):
        worker.spill(h, block(float(h)))
    assert disk.entered.wait(10)  # writing 1: the disk hangs
    assert not worker.close(timeout=0.2)
    assert worker.spills_dropped == 2 and sorted(worker.take_lost()) == [2, 3]
    assert not worker.running and not worker.stopped
    disk.gate.set()  # the disk recovers: the thread writes the block it held and ends
    deadline = time.monotonic() + 10
    while not worker.stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.stopped and disk.hashes() == [1]
