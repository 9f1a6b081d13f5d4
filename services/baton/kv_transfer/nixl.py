"""The NIXL transport's data plane: one-sided RDMA-style READs of the holder's blocks (UCX
backend).

The control plane is every network transport's (`network.py`: bounded frames, the
handshake with the layout fingerprint and the secret's challenge, pull, ack, leases); the
data moves through NIXL:
each side registers its whole KV cache tensor with its agent once, a puller loads the
holder's agent metadata on its first hello (handed out only after the handshake; again if
the holder restarts under the same address: the pull reply names the holder's agent), and
for a pull the holder only confirms the lease; the puller then posts one READ with a
descriptor per (layer, K/V, run of consecutive blocks) on both sides and polls it to DONE,
straight from the holder's cache into its own destination blocks; its `ack` ends the lease.

DRAM on CPU machines, VRAM on GPUs (the descriptors carry the cache's device); nothing
on either side views the cache from the host (the layouts' fingerprints name the device
type, so a DRAM and a VRAM peer refuse each other at the handshake). The wheel is
`nixl-cu12` (module `nixl_cu12`) on CPU machines, `nixl-cu13` on GPUs (torch's CUDA 13 line);
some images ship it as `nixl`.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import select
import threading
import time
import uuid
from types import ModuleType
from typing import Any

import torch

from baton.common.internal import KVEndpointInfo, KVLayoutInfo
from baton.kv_transfer.base import PeerUnreachableError, TransferError, bytes_per_block
from baton.kv_transfer.dataplane import DATA_TIMEOUT_S, Incoming, Outgoing, Remaining
from baton.kv_transfer.wire import send_msg

_POLL_S = 0.0002


def nixl_modules() -> tuple[str, ...]:
    """NIXL's module names, the build matching torch's CUDA line first: `nixl-cu13` (the gpu
    extra, beside torch's CUDA 13 wheel), `nixl-cu12` (the nixl extra, CPU machines)."""
    first = "nixl_cu13" if (torch.version.cuda or "").startswith("13") else "nixl_cu12"
    return tuple(dict.fromkeys((first, "nixl_cu12", "nixl_cu13", "nixl")))


def _import_nixl() -> ModuleType:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout
    for module in (f"{name}._api" for name in nixl_modules()):
        try:
            return __import__(module, fromlist=["nixl_agent", "nixl_agent_config"])
        except ImportError:
            continue
    raise RuntimeError("the nixl KV transport needs the NIXL Python package: "
                       "`pip install nixl-cu12==1.5.1` on CPU, `nixl-cu13==1.5.1` beside "
                       "torch's CUDA 13 wheel (or use --kv-transport tcp)")


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length): stretches where both sides' ids run consecutively,
    so the two descriptor lists pair one to one."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


class NixlPlanes:
    """Imports NIXL when made (RuntimeError naming the package when it is missing); on a
    loopback `host`, UCX is kept to the loopback device."""

    def __init__(self, host: str) -> None:
        if host in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only, read at agent init
        self.nixl = _import_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)

    def open(self, kv_cache: torch.Tensor, layout: KVLayoutInfo, engine_id: str
             ) -> NixlPlane:
        return NixlPlane(self.nixl, kv_cache, layout, engine_id)


class NixlPlane:
    """Our agent, with the whole cache registered (VRAM on CUDA, DRAM else), and the
    holders' agents we have loaded (by address)."""

    head_subsets = False

    def __init__(self, nixl: ModuleType, kv_cache: torch.Tensor, layout: KVLayoutInfo,
                 engine_id: str) -> None:
        self.kv_cache, self.layout = kv_cache, layout
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        # Pull threads and the holder's serving threads share the agent: NIXL must lock.
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent: Any = nixl.nixl_agent(self.agent_name, config)
        # the tensor as it is: its address, length and device (VRAM on CUDA), no host view
        self._registered = self.agent.register_memory([kv_cache])
        self._mem = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device = kv_cache.get_device() if kv_cache.is_cuda else 0
        self._block_bytes = bytes_per_block(layout)
        self._peers: dict[str, tuple[str, int, int]] = {}  # address -> (agent, base, blocks)
        self._peers_lock = threading.Lock()

    def _descs(self, base: int, num_blocks: int, runs: list[tuple[int, int]]
               ) -> list[tuple[int, int, int]]:
        """(address, length, device) per (layer, K/V, run of consecutive blocks), for a
        cache laid out like ours with `num_blocks` blocks starting at `base`."""
        layers2 = self.layout.num_layers * 2
        seg = self._block_bytes // layers2
        return [(base + (lk * num_blocks + start) * seg, n * seg, self._device)
                for lk in range(layers2) for start, n in runs]

    # -- holder ----------------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        # A hello also hands out our agent metadata and where our cache starts.
        md = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"ok": True, "agent": self.agent_name, "metadata": md,
                "base": self.kv_cache.data_ptr(), "blocks": self.kv_cache.shape[2]}

    def send(self, out: Outgoing) -> None:
        # The puller READs the blocks itself; we say the lease is taken and by whom, then
        # drive our agent's progress until the puller's ack arrives (no progress thread:
        # it would spin a core forever; this spins only while a pull is in flight).
        send_msg(out.conn, {"ok": True, "nbytes": len(out.blocks) * self._block_bytes,
                            "agent": self.agent_name})
        deadline = time.monotonic() + (out.conn.gettimeout() or DATA_TIMEOUT_S)
        while not select.select([out.conn], [], [], 0)[0]:
            if time.monotonic() > deadline:
                raise TimeoutError("the puller never acknowledged")
            self.agent.get_new_notifs()  # runs UCX's progress engine (the agent locks)
            time.sleep(_POLL_S)

    # -- puller ----------------------------------------------------------------------------
    def greeted(self, peer: KVEndpointInfo, reply: dict[str, Any]) -> None:
        self._load(peer, reply)

    def _load(self, peer: KVEndpointInfo, reply: dict[str, Any]) -> tuple[str, int, int]:
        """The holder's agent from its hello, replacing the one a restarted holder had."""
        with self._peers_lock:
            old = self._peers.get(peer.address)
            if old is not None and old[0] != reply.get("agent"):
                try:  # the holder restarted: forget its old agent
                    self.agent.remove_remote_agent(old[0])
                except Exception:  # noqa: BLE001 - already gone
                    pass
            base, blocks, md = reply.get("base"), reply.get("blocks"), reply.get("metadata")
            if (type(base) is not int or type(blocks) is not int or base < 0 or blocks < 0
                    or not isinstance(md, str)):
                raise PeerUnreachableError(f"{peer.address} sent a malformed NIXL hello")
            name = self.agent.add_remote_agent(base64.b64decode(md))
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[peer.address] = (name, base, blocks)
            return self._peers[peer.address]

    def session(self, peer: KVEndpointInfo, remaining: Remaining
                ) -> contextlib.nullcontext[dict[str, Any]]:
        return contextlib.nullcontext({})

    def receive(self, pull: Incoming) -> int:
        n, address = len(pull.src), pull.peer.address
        if n == 0:
            return 0
        known = self._peers.get(address)
        if known is None or known[0] != pull.reply.get("agent"):
            known = self._load(pull.peer, pull.hello(pull.remaining()))
        agent, base, peer_blocks = known
        if max(pull.src) >= peer_blocks:  # never READ past the cache the holder registered
            raise TransferError(f"blocks {[b for b in pull.src if b >= peer_blocks][:5]} are "
                                f"outside {address}'s {peer_blocks}-block cache")
        runs = paired_runs(pull.src, pull.dst)
        local = self.agent.get_xfer_descs(
            self._descs(self.kv_cache.data_ptr(), self.kv_cache.shape[2],
                        [(d, k) for _, d, k in runs]), self._mem)
        remote = self.agent.get_xfer_descs(
            self._descs(base, peer_blocks, [(s, k) for s, _, k in runs]), self._mem)
        try:
            handle = self.agent.initialize_xfer("READ", local, remote, agent)
        except Exception as err:  # noqa: BLE001 - nixl raises its own types
            raise PeerUnreachableError(f"NIXL cannot read from {address}: {err}") from None
        try:
            self._wait(handle, pull)
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an aborted handle may refuse; it is freed later
                pass
        return n * self._block_bytes

    def _wait(self, handle: object, pull: Incoming) -> None:
        """Post the READ and poll it to DONE (TransferTimeoutError past the deadline)."""
        address = pull.peer.address
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                pull.remaining()  # raises TransferTimeoutError past the deadline
                time.sleep(_POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerUnreachableError(f"NIXL READ from {address} failed ({state})")
        except TransferError:
            raise
        except Exception as err:  # noqa: BLE001 - a dead peer surfaces as nixl errors
            raise PeerUnreachableError(f"NIXL READ from {address} failed: {err}") from None

    def close(self) -> None:
        if self.agent is None:
            return
        for name, _, _ in list(self._peers.values()):
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass
        try:
            self.agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001
            pass
        self.agent = None  # the agent and its UCX workers go with the last reference
