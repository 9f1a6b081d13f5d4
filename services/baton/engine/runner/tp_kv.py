"""A tensor-parallel follower's KV transfer (`kv_connector/tp_ranks.py` is rank 0's side):
its own tcp transport over its own cache (its KV heads), holder and puller, driven by rank
0's control frames (`tp_wire.Control`) and answered with JSON lines on its stdout, every
message typed in `tp_kv_messages.py`:

    KVStart {engine_id}                        -> KVStarted {endpoint | error}
    KVHold {lease, blocks, ttl}                (a copy of the lease rank 0 just made)
    KVRelease {lease}                          (rank 0's lease ended unpulled)
    KVPull {tag, lease, peers, src, dst, timeout}  -> KVPulled {tag, ok, kind, error, bytes}
    (a lease copy that ends)                   -> KVReleased {lease, reason}

Each rank's holder listens on `kv_port + rank` (any free port when kv_port is 0) and uses
the engine's id, so a puller's ranks and a holder's ranks meet as one engine; a follower
serves only leases rank 0 made (their ids come from rank 0), each at most until its TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import BinaryIO

from baton.engine.runner.tp_kv_messages import (
    KVControl,
    KVHold,
    KVPull,
    KVPulled,
    KVRelease,
    KVReleased,
    KVStart,
    KVStarted,
)
from baton.kv_transfer import make_transport
from baton.kv_transfer.base import Transfer, TransferState, head_plan, rank_heads
from baton.kv_transfer.network import NetworkTransport

log = logging.getLogger("baton.tp_worker")
REPORT_INTERVAL_S = 0.005


class FollowerKV:
    def __init__(self, runner, rank: int, size: int, out: BinaryIO) -> None:
        self.runner, self.rank, self.size, self.out = runner, rank, size, out
        self.transport: NetworkTransport | None = None
        self._pulls: dict[str, list[Transfer]] = {}
        self._lock = threading.Lock()  # _pulls and writes to `out`
        self._stopped = threading.Event()

    def handle(self, msg: KVControl) -> None:
        try:
            if isinstance(msg, KVStart):
                self._start(msg.engine_id)
            elif isinstance(msg, KVHold):
                self._started().leases.hold(msg.lease, msg.blocks, msg.ttl, lease_id=msg.lease)
            elif isinstance(msg, KVRelease):
                self._started().release(msg.lease)
            else:
                self._pull(msg)
        except Exception as err:  # noqa: BLE001 - rank 0 hears of it; this rank goes on
            log.exception("KV control %s failed", msg.op)
            if isinstance(msg, KVPull):
                self._reply(KVPulled(tag=msg.tag, ok=False, kind=type(err).__name__,
                                     error=str(err)))
            elif isinstance(msg, KVStart):
                self._reply(KVStarted(error=f"{type(err).__name__}: {err}"))

    def _started(self) -> NetworkTransport:
        if self.transport is None:
            raise RuntimeError("a KV control message before kv_start")
        return self.transport

    def _start(self, engine_id: str) -> None:
        config = self.runner.config
        total = self.runner.model_config.num_kv_heads
        start, _ = rank_heads(self.rank, self.size, total)
        port = config.kv_transfer.port + self.rank if config.kv_transfer.port else 0
        self.transport = make_transport("tcp", host=config.kv_transfer.host, port=port,
                                        secret=config.kv_transfer.secret,
                                        heads=(start, total, self.size))
        endpoint = self.transport.start(self.runner.kv_cache, engine_id)
        threading.Thread(target=self._report, name="baton-tp-kv", daemon=True).start()
        self._reply(KVStarted(endpoint=endpoint))

    def _pull(self, msg: KVPull) -> None:
        transport = self._started()
        plan = head_plan(transport.layout, msg.peers, self.rank)
        transfers = [transport.pull(peer, msg.lease, msg.src, msg.dst, msg.timeout,
                                    heads=heads, part=part)
                     for peer, heads, part in plan]
        with self._lock:
            self._pulls[msg.tag] = transfers

    def _report(self) -> None:
        """Finished pulls and ended lease copies, to rank 0."""
        while not self._stopped.is_set():
            for lease_id, reason in self._started().released():
                self._reply(KVReleased(lease=lease_id, reason=reason))
            with self._lock:
                done = {tag: ts for tag, ts in self._pulls.items()
                        if all(t.is_finished for t in ts)}
                for tag in done:
                    del self._pulls[tag]
            for tag, ts in done.items():
                failed = next((t for t in ts if t.state != TransferState.DONE), None)
                self._reply(KVPulled(tag=tag, ok=failed is None,
                                     kind=type(failed.error).__name__ if failed else "",
                                     error=str(failed.error) if failed else "",
                                     bytes=sum(t.bytes for t in ts)))
            time.sleep(REPORT_INTERVAL_S)

    def _reply(self, msg: KVStarted | KVPulled | KVReleased) -> None:
        with self._lock:
            self.out.write((msg.model_dump_json() + "\n").encode())
            self.out.flush()

    def close(self) -> None:
        self._stopped.set()
        if self.transport is not None:
            self.transport.close()
