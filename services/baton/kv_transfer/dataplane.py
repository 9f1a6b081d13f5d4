"""The data plane contract: how a pull's bytes move, behind the one control plane.

Every network transport is the same control plane (`network.py`: the holder's server,
the handshake, leases, the puller's sessions) and one data plane, chosen by the
transport's name in `TRANSPORTS`:

- `iov.py` (tcp, a host cache): the blocks' own memory over the control socket,
  scatter/gather;
- `staging.py` (tcp, any other cache): chunk by chunk through a bounded host buffer;
- `gloo.py` (gloo / nccl): a torch.distributed group per peer pair;
- `nixl.py` (nixl): one-sided UCX READs of the registered cache.

A `PlaneMaker` is made with the transport (its options; it may refuse them, or a missing
package, there) and opens a `DataPlane` over the cache at `start`. The control plane calls
the plane from its server's connection threads (`hello`, `send`) and its pull workers
(`greeted`, `session`, `receive`), many at once: a plane is thread-safe.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer.messages import PullRequest

Remaining = Callable[[], float]  # seconds left; raises TransferTimeoutError past the deadline
DATA_TIMEOUT_S = 60.0  # an authenticated peer's data phase and ack, on the holder


class DataUnavailable(Exception):
    """The holder cannot serve a pull's bytes (its device refused the copy, no staging
    buffer came free); raised before the data header, so the puller is told why."""


@dataclass(frozen=True)
class Outgoing:
    """One pull's data phase on the holder: the lease's `blocks` (checked), the local KV
    heads [lo, hi) asked for (None: all), for the authenticated `peer` ("<id>@<ip>")."""

    conn: socket.socket
    blocks: list[int]
    heads: tuple[int, int] | None
    peer: str
    request: PullRequest


@dataclass(frozen=True)
class Incoming:
    """One pull's data phase on the puller: the holder's header (`reply`, not yet checked),
    its blocks `src` into our `dst`, the global KV `heads` to move (all of ours unless the
    pull names a subset); `hello(timeout_s)` runs a fresh handshake and info request."""

    sock: socket.socket
    reply: dict[str, Any]
    peer: KVEndpointInfo
    src: list[int]
    dst: list[int]
    heads: tuple[int, int]
    remaining: Remaining
    hello: Callable[[float], dict[str, Any]]


class DataPlane(Protocol):
    """The bytes of pulls over one registered cache."""

    head_subsets: bool  # whether a pull may name a subset of the holder's KV heads

    def hello(self) -> dict[str, Any]:
        """Holder: its answer to an authenticated `info` request (nixl: its agent)."""
        ...

    def greeted(self, peer: KVEndpointInfo, reply: dict[str, Any]) -> None:
        """Puller: what `peer` answered to `info` on connect. Raises PeerUnreachableError
        for an answer it cannot use."""
        ...

    def session(self, peer: KVEndpointInfo, remaining: Remaining
                ) -> AbstractContextManager[dict[str, Any]]:
        """Puller: around one pull's connection, request and data phase; yields the fields
        it adds to the pull request."""
        ...

    def send(self, out: Outgoing) -> None:
        """Holder: the data header (`{"ok": true, "nbytes": ...}` and the plane's fields)
        on `out.conn`, then the bytes however this plane moves them; returns once the
        puller can ack. Raises DataUnavailable before the header when the bytes cannot be
        had, OSError (or TimeoutError) after it."""
        ...

    def receive(self, pull: Incoming) -> int:
        """Puller: check the header, move the bytes into our `dst` blocks; the bytes taken.
        Raises a TransferError (typed), TimeoutError or OSError."""
        ...

    def close(self) -> None:
        """Free what the plane holds (buffers, groups, its agent); pulls have ended."""
        ...


class PlaneMaker(Protocol):
    """A transport's data plane before its cache: made with the transport."""

    def open(self, kv_cache: torch.Tensor, layout: KVLayoutInfo, engine_id: str) -> DataPlane:
        """The plane over `kv_cache` (contiguous, laid out as `layout`) of engine
        `engine_id`; ValueError for a cache this plane cannot move."""
        ...
