"""The gloo / nccl transports' pair groups: one two-rank torch.distributed group per peer
pair, built on the first pull between them and reused for every later one.

A holder keys its pairs by the puller's authenticated identity (the handshake's
"<engine id>@<ip>"), a puller by the holder's address. The holder names each group it
builds (`gen`, random); a puller's pull request names the group it has (or none), and the
holder reuses its group only when the names agree, else builds a new one and says where
its store is: so a restarted holder, a restarted puller, or one side that dropped its
group after a failure all lead to a new group on both sides and the old ones torn down.
A group is destroyed (its store with it) when a send / recv on it fails, when its peer
cannot be reached, when it sits unused past the table's idle limit, and at close().

Pulls on one pair are serialised (`Pair.lock`): point-to-point messages on one group must
be ordered; each send / recv also carries the tag the holder chose for that pull.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store  # where torch.distributed's comes from

IDLE_S = 600.0  # a pair unused this long is torn down (its peer may be gone for good)


class PairGroup(Protocol):
    """What a pair's group does: point-to-point sends and receives (gloo's and NCCL's
    backends have them; torch's type stubs do not say so)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


def build_group(store: Store, rank: int, timeout: timedelta, backend: str) -> PairGroup:
    """The two-rank group over `store` (the holder is rank 0); blocks until both joined."""
    group: object
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, 2, opts)
    else:
        group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    return cast(PairGroup, group)  # the stubs' Backend lacks send / recv


@dataclass
class Pair:
    gen: str  # the holder's name for this group
    store: Store | None  # a TCPStore: the holder's is the server; None once destroyed
    group: PairGroup | None  # gloo / NCCL; None until built, and once destroyed
    stream: torch.cuda.Stream | None = None  # CUDA: the side stream its sends / recvs run on
    tags: int = 0  # holder: the last tag it handed out
    used: float = field(default_factory=time.monotonic)

    def next_tag(self) -> int:
        """Holder: the tag of the next pull's message."""
        self.tags = self.tags % 1_000_000 + 1
        self.touch()
        return self.tags

    def touch(self) -> None:
        self.used = time.monotonic()


def destroy(pair: Pair) -> None:
    """Tear the group down (its threads, sockets, NCCL communicator) and drop the store."""
    for stop in ("abort", "shutdown"):
        try:
            getattr(pair.group, stop)()
            break
        except Exception:  # noqa: BLE001 - already broken, or not supported: dropped anyway
            continue
    pair.group = pair.store = pair.stream = None


class PairTable:
    """Pairs by key, with a lock per key that serialises the pulls on it. Thread-safe.
    `built` / `destroyed` count groups over the table's life (what tests check)."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self.built = 0
        self.destroyed = 0
        self._pairs: dict[str, Pair] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def lock(self, key: str) -> threading.Lock:
        """The lock that orders the pulls between us and `key`."""
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    def get(self, key: str) -> Pair | None:
        with self._lock:
            return self._pairs.get(key)

    def put(self, key: str, pair: Pair) -> None:
        """A group just built for `key`, replacing (destroying) any older one."""
        with self._lock:
            old = self._pairs.get(key)
            self._pairs[key] = pair
            self.built += 1
        if old is not None:
            self._destroy(old)
        self.reap()

    def drop(self, key: str) -> None:
        """Destroy `key`'s group, if it has one (failed, or its peer is gone)."""
        with self._lock:
            old = self._pairs.pop(key, None)
        if old is not None:
            self._destroy(old)

    def reap(self) -> None:
        """Destroy the groups unused for `idle_s`, whose lock nobody holds."""
        now = time.monotonic()
        with self._lock:
            idle = [k for k, p in self._pairs.items() if now - p.used > self.idle_s
                    and not self._locks.get(k, threading.Lock()).locked()]
            gone = [self._pairs.pop(k) for k in idle]
        for pair in gone:
            self._destroy(pair)

    def close(self) -> None:
        with self._lock:
            gone, self._pairs = list(self._pairs.values()), {}
        for pair in gone:
            self._destroy(pair)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pairs)

    def _destroy(self, pair: Pair) -> None:
        destroy(pair)
        with self._lock:
            self.destroyed += 1
