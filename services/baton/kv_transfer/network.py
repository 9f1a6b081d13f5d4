"""The network transports (tcp, gloo / nccl, nixl): one control plane and a data plane.

The control plane is the same for all of them, one request per connection: the handshake
of `handshake.py` over the bounded frames of `wire.py` (magic and version, layout
fingerprint, the HMAC challenge when a secret is configured), then the request: `info`
(the holder's hello) or `pull` (a lease id and the holder's block ids), leases bound to
the first puller that claims them (`leases.py`), then the puller's `ack`. The holder's
side is `server.py`, the puller's `puller.py`. How the bytes move between the header and
the ack is the data plane's (`dataplane.py`), chosen by the transport's name in
`TRANSPORTS`; the control plane never takes a host view of a device cache.

Nothing a peer sends sizes an allocation: frames are bounded, block ids must fall inside
the holder's cache and its lease, the data's size follows from the ids each side knows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer import handshake
from baton.kv_transfer.base import KVTransport, Transfer
from baton.kv_transfer.dataplane import DataPlane, PlaneMaker
from baton.kv_transfer.handshake import HolderTerms, PullerTerms
from baton.kv_transfer.leases import LeaseTable
from baton.kv_transfer.puller import Puller
from baton.kv_transfer.server import HolderServer
from baton.kv_transfer.wire import MAX_FRAME_BYTES


@dataclass(frozen=True)
class ControlOptions:
    """The control plane's settings, the same for every network transport. `heads`: this
    rank's (head_start, total_kv_heads, tp_size) under tensor parallelism."""

    host: str = "127.0.0.1"
    port: int = 0
    max_pulls: int = 8
    secret: str | None = None
    handshake_timeout_s: float = handshake.HANDSHAKE_TIMEOUT_S
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_handshakes: int = 64
    max_handshakes_per_peer: int = 16  # from one address (a pod: its ranks' pulls)
    heads: tuple[int, int, int] = (0, 0, 1)

    def __post_init__(self) -> None:
        if self.secret is not None and not self.secret:
            raise ValueError("the KV secret must be None (no authentication) or non-empty")
        if self.handshake_timeout_s <= 0 or self.max_frame_bytes < 4096 \
                or self.max_handshakes < 1 or self.max_handshakes_per_peer < 1:
            raise ValueError(f"handshake_timeout_s={self.handshake_timeout_s} must be > 0, "
                             f"max_frame_bytes={self.max_frame_bytes} >= 4096, "
                             f"max_handshakes={self.max_handshakes} >= 1, "
                             f"max_handshakes_per_peer={self.max_handshakes_per_peer} >= 1")
        object.__setattr__(self, "heads", tuple(self.heads))


class NetworkTransport(KVTransport):
    """The transport `name`: the control plane with `options`, and the data plane `planes`
    opens over the cache at `start`. Attributes set by `start`: `kv_cache`, `layout`,
    `endpoint`, `plane`, `puller`."""

    def __init__(self, name: str, planes: PlaneMaker, options: ControlOptions) -> None:
        self.name, self.planes, self.options = name, planes, options
        self.leases = LeaseTable()
        self.refused = handshake.RefusalLog()  # holder: connections refused, and their log
        self.kv_cache: torch.Tensor | None = None
        self.layout: KVLayoutInfo | None = None
        self.endpoint: KVEndpointInfo | None = None
        self.plane: DataPlane | None = None
        self.puller: Puller | None = None
        self._server: HolderServer | None = None

    # -- holder ----------------------------------------------------------------------------
    def start(self, kv_cache: torch.Tensor, engine_id: str) -> KVEndpointInfo:
        if not kv_cache.is_contiguous():
            raise ValueError(f"the {self.name} transport needs a contiguous KV cache tensor")
        opts = self.options
        layout = KVLayoutInfo.of(kv_cache, *opts.heads)
        plane = self.planes.open(kv_cache, layout, engine_id)
        self.kv_cache, self.layout, self.plane = kv_cache, layout, plane
        num_blocks = int(kv_cache.shape[2])
        self.leases.num_blocks = num_blocks
        terms = HolderTerms(engine_id, str(layout), layout.fingerprint, num_blocks,
                            opts.secret, opts.handshake_timeout_s, opts.max_frame_bytes)
        self._server = HolderServer(opts.host, opts.port, terms, layout, plane, self.leases,
                                    self.refused, opts.max_handshakes,
                                    opts.max_handshakes_per_peer)
        self.endpoint = KVEndpointInfo(self.name, engine_id, self._server.address, layout)
        self.puller = Puller(self.name, PullerTerms(engine_id, layout.fingerprint,
                                                    opts.secret, opts.max_frame_bytes),
                             layout, num_blocks, plane, opts.max_pulls)
        return self.endpoint

    def hold(self, request_id: str, block_ids: list[int], ttl_s: float) -> str:
        return self.leases.hold(request_id, block_ids, ttl_s)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def released(self) -> list[tuple[str, str]]:
        return self.leases.released()

    # -- puller ----------------------------------------------------------------------------
    def _started(self) -> Puller:
        if self.puller is None:
            raise RuntimeError(f"the {self.name} transport pulls once start() has run")
        return self.puller

    def connect(self, peer: KVEndpointInfo, timeout_s: float = 5.0) -> None:
        self._started().connect(peer, timeout_s)

    def pull(self, peer: KVEndpointInfo, lease_id: str, src_block_ids: list[int],
             dst_block_ids: list[int], timeout_s: float,
             heads: tuple[int, int] | None = None, part: tuple[int, int] = (0, 1)
             ) -> Transfer:
        """`heads`: the global KV heads to move (default: all of ours), held by `peer` and
        by us, a subset only on a data plane with `head_subsets` (tcp); `part`: (i, n), the
        i-th of the n pulls of our engine's ranks that read this lease (`head_plan`
        computes both over a holder's ranks)."""
        return self._started().pull(peer, lease_id, src_block_ids, dst_block_ids, timeout_s,
                                    heads, part)

    def close(self) -> None:
        """Stop serving (the port is free once this returns), report held leases
        released, wait out running pulls, then free the data plane."""
        if self._server is not None:
            self._server.close()
        self.leases.release_all()
        if self.puller is not None:
            self.puller.close()
        if self.plane is not None:
            self.plane.close()
