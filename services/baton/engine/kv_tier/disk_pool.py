"""`DiskKVPool`: KV blocks in a bounded directory, the tier under the host pool, so a pod
restarted on the same disk comes back with its sessions' prefixes.

One file per block, `<root>/<fingerprint>/<block hash, 16 hex>.kv`: the magic, the
BLAKE2b-256 digest of the payload, then the payload (the host block's bytes). The
fingerprint names the model and the cache layout (`fingerprint()`), so blocks of another
model, dtype or block shape are never read. A file is written to a temporary name and
renamed, so a crash leaves whole files or none (temporary files left by one are deleted at
start); one whose size, magic or digest does not match is deleted and reported missing.
Least recently used files go first when the directory holds `num_blocks`; at start the files
there are indexed oldest (mtime) first.

Threads: `store` and `read` do the file I/O and run on the tier's `DiskWorker` thread (or on
the engine thread once the worker has stopped, at a graceful stop); the index they share
with the engine thread (`in`, `touch`, `hashes`) is under a lock that no I/O holds. The
hashes of files that went (size bound, damage) wait in `take_dropped()` for the engine
thread, which unpublishes them.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

MAGIC = b"BATONKV1"
_DIGEST = 32
_SUFFIX = ".kv"


def fingerprint(model_dir: Path, block: torch.Tensor) -> str:
    """A name for the model's weights and config (each file's name, size and mtime under
    `model_dir`) and one block's layout (shape, dtype)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(model_dir.resolve()).encode())
    paths = [model_dir] if model_dir.is_file() else sorted(
        p for p in model_dir.iterdir() if p.is_file())
    for path in paths:
        stat = path.stat()
        h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    h.update(f"{tuple(block.shape)}:{block.dtype}".encode())
    return h.hexdigest()


class DiskKVPool:
    def __init__(self, root: Path, fingerprint: str, block_bytes: int, num_blocks: int) -> None:
        """Raises ValueError for `num_blocks` < 1; OSError when the directory cannot be
        made."""
        if num_blocks < 1:
            raise ValueError(f"DiskKVPool needs at least one block, got {num_blocks}")
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.written = 0  # blocks written since start
        self._lock = threading.Lock()
        self._dropped: collections.deque[int] = collections.deque()
        for tmp in self.dir.glob("*.tmp"):  # a write a crash cut short
            tmp.unlink(missing_ok=True)
        files = sorted(self.dir.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime_ns)
        self._files: OrderedDict[int, Path] = OrderedDict(
            (int(p.stem, 16), p) for p in files if _is_hash(p.stem))
        self._unlink(self._trim())

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def touch(self, block_hash: int) -> None:
        """Mark a held block most recently used (no-op for one not held)."""
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)

    def store(self, block_hash: int, block: torch.Tensor) -> None:
        """Write `block` (a contiguous CPU tensor, its copies complete) under `block_hash`;
        a held hash is only touched. Raises OSError when the file cannot be written."""
        if block.device.type != "cpu":
            raise ValueError(f"DiskKVPool stores host blocks, got one on {block.device}")
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return
        payload = block.view(torch.uint8).view(-1).numpy().data  # the block's own bytes
        path = self.dir / f"{block_hash:016x}{_SUFFIX}"
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")  # one writer per name
        with open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.blake2b(payload, digest_size=_DIGEST).digest())
            f.write(payload)
        os.replace(tmp, path)
        with self._lock:
            self._files[block_hash] = path
            self.written += 1
            gone = self._trim()
        self._unlink(gone)

    def read(self, block_hash: int, out: torch.Tensor) -> bool:
        """Read the block into `out` (a contiguous CPU tensor of the block's size, filled in
        place: no staging copy) and touch it. False, the file deleted and `out` undefined:
        missing, cut short, too long or not what was written."""
        with self._lock:
            path = self._files.get(block_hash)
        if path is None:
            return False
        dest = out.view(torch.uint8).view(-1).numpy().data  # filled in place
        head = bytearray(len(MAGIC) + _DIGEST)
        try:
            with open(path, "rb") as f:
                whole = (f.readinto(head) == len(head) and f.readinto(dest) == self.block_bytes
                         and not f.read(1))
        except OSError:
            whole = False
        if not whole or head[:len(MAGIC)] != MAGIC or hashlib.blake2b(
                dest, digest_size=_DIGEST).digest() != head[len(MAGIC):]:
            with self._lock:
                self._files.pop(block_hash, None)
            self._unlink([(block_hash, path)])
            return False
        self.touch(block_hash)
        return True

    def hashes(self) -> list[int]:
        """Every hash held (a snapshot, any thread)."""
        with self._lock:
            return list(self._files)

    def take_dropped(self) -> list[int]:
        """The hashes whose files went since the last call (size bound, damage)."""
        out = []
        while self._dropped:
            out.append(self._dropped.popleft())
        return out

    def _trim(self) -> list[tuple[int, Path]]:
        """Under the lock: take the least recently used files over the size out of the
        index; the caller unlinks them outside it."""
        gone = []
        while len(self._files) > self.num_blocks:
            gone.append(self._files.popitem(last=False))
        return gone

    def _unlink(self, gone: list[tuple[int, Path]]) -> None:
        for block_hash, path in gone:
            path.unlink(missing_ok=True)
            self._dropped.append(block_hash)


def _is_hash(stem: str) -> bool:
    return len(stem) == 16 and all(c in "0123456789abcdef" for c in stem)
