"""The disk tier: blocks round-trip bit for bit, the directory stays within its size (least
recently used first), a damaged file is dropped rather than read, another fingerprint's
files are never seen, and a new pool over the same directory finds what the last one wrote;
under a host pool, its evictions spill there and come back through reads on its worker."""

from __future__ import annotations

import torch

from baton.engine.kv_tier import DiskKVPool, HostKVPool

SHAPE = (2, 2, 4, 1, 3)  # one block: (layers, K/V, block_size, KVH, D)
BYTES = 2 * 2 * 4 * 3 * 4


def block(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value)


def test_blocks_round_trip_and_the_directory_keeps_its_size(tmp_path):
    disk = DiskKVPool(tmp_path, "fp", BYTES, 2)
    disk.store(1, block(1.0))
    disk.store(2, block(2.0))
    out = torch.zeros(SHAPE)
    assert disk.read(1, out) and torch.equal(out, block(1.0))  # 1 is now most recent
    disk.store(3, block(3.0))  # over its size: 2, least recently used, goes
    assert 2 not in disk and 1 in disk and 3 in disk
    assert sorted(p.name for p in (tmp_path / "fp").iterdir()) == [
        f"{1:016x}.kv", f"{3:016x}.kv"]
    assert not disk.read(2, out) and disk.written == 3


def test_a_damaged_file_is_dropped_not_read(tmp_path):
    disk = DiskKVPool(tmp_path, "fp", BYTES, 4)
    disk.store(7, block(7.0))
    path = tmp_path / "fp" / f"{7:016x}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    out = torch.zeros(SHAPE)
    assert not disk.read(7, out) and 7 not in disk and not path.exists()
    disk.store(8, block(8.0))
    (tmp_path / "fp" / f"{8:016x}.kv").write_bytes(b"BATONKV1")  # cut short
    assert not disk.read(8, out) and 8 not in disk
    disk.store(9, block(9.0))
    longer = tmp_path / "fp" / f"{9:016x}.kv"
    longer.write_bytes(longer.read_bytes() + b"\0")  # one byte too many
    assert not disk.read(9, out) and 9 not in disk
    assert disk.take_dropped() == [7, 8, 9]


def test_a_new_pool_finds_the_last_ones_blocks_of_its_fingerprint_only(tmp_path):
    first = DiskKVPool(tmp_path, "model-a", BYTES, 4)
    for h in (11, 12, 13):
        first.store(h, block(float(h)))
    stray = tmp_path / "model-a" / f"{14:016x}.123.tmp"  # a write a crash cut short
    stray.write_bytes(b"BATONKV1")
    again = DiskKVPool(tmp_path, "model-a", BYTES, 2)  # smaller: the oldest file goes
    assert sorted(again.hashes()) == [12, 13] and not stray.exists()
    assert again.take_dropped() == [11]
    out = torch.zeros(SHAPE)
    assert again.read(13, out) and torch.equal(out, block(13.0))
    assert len(DiskKVPool(tmp_path, "model-b", BYTES, 4)) == 0


def test_the_host_pool_spills_to_disk_and_reads_back(tmp_path):
    cache = torch.stack([torch.full((2, 2, 4, 1, 3), float(i)) for i in range(4)], dim=2)
    disk = DiskKVPool(tmp_path, "fp", BYTES, 8)
    host = HostKVPool(cache, 2, disk=disk)  # (layers, K/V, 4 blocks, bs, KVH, D) above
    assert host.io is not None
    for h, block_id in ((10, 0), (11, 1), (12, 2)):
        host.store(h, block_id)
    assert 10 not in host and host.on_disk(10)  # evicted, its spill queued or written
    assert host.io.wait_idle(10) and 10 in disk
    assert host.start_read(10) and host.reading(10) and 10 not in host
    assert host.io.wait_idle(10)
    assert host.finish_io() == [] and 10 in host and host.disk_hits == 1
    host.load(10, 3)  # back into device block 3: block 0's KV
    assert torch.equal(cache[:, :, 3], torch.zeros_like(cache[:, :, 3]))
    assert not host.start_read(99)  # on neither
    assert host.close() and not host.io.running
    host.flush()  # on this thread now
    assert all(h in disk for h in (10, 11, 12))
