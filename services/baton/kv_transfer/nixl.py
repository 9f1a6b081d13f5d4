"""NIXL transport: one-sided RDMA-style READs of the holder's blocks (UCX backend).

The control plane is the tcp transport's (bounded frames, the handshake with the layout
fingerprint and the secret's challenge, pull, ack, leases); the data moves through NIXL:
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
import logging
import os
import select
import socket
import threading
import time
import uuid

import torch

from baton.kv_transfer.base import Endpoint, PeerUnreachableError, TransferError
from baton.kv_transfer.messages import PullRequest
from baton.kv_transfer.tcp import TcpTransport
from baton.kv_transfer.wire import send_msg

_POLL_S = 0.0002


def nixl_modules() -> tuple[str, ...]:
    """NIXL's module names, the build matching torch's CUDA line first: `nixl-cu13` (the gpu
    extra, beside torch's CUDA 13 wheel), `nixl-cu12` (the nixl extra, CPU machines)."""
    first = "nixl_cu13" if (torch.version.cuda or "").startswith("13") else "nixl_cu12"
    return tuple(dict.fromkeys((first, "nixl_cu12", "nixl_cu13", "nixl")))


def _import_nixl():
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


class NixlTransport(TcpTransport):
    name = "nixl"
    head_subsets = False

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_pulls: int = 8,
                 **control) -> None:
        super().__init__(host, port, max_pulls, **control)  # control: tcp's secret, limits
        if host in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only, read at agent init
        self._nixl = _import_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.agent = None
        self._peers: dict[str, tuple[str, int, int]] = {}  # address -> (agent, base, blocks)
        self._peers_lock = threading.Lock()

    # -- both sides ------------------------------------------------------------------------
    def start(self, kv_cache: torch.Tensor, engine_id: str) -> Endpoint:
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:8]}"
        # Pull threads and the holder's serving threads share the agent: NIXL must lock.
        config = self._nixl.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"],
            sync_mode=self._nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = self._nixl.nixl_agent(self.agent_name, config)
        if not kv_cache.is_contiguous():
            raise ValueError("the nixl transport needs a contiguous KV cache tensor")
        # the tensor as it is: its address, length and device (VRAM on CUDA), no host view
        self._registered = self.agent.register_memory([kv_cache])
        self._mem = "VRAM" if kv_cache.is_cuda else "DRAM"
        self._device = kv_cache.get_device() if kv_cache.is_cuda else 0
        return self._start(kv_cache, engine_id)

    def _descs(self, base: int, num_blocks: int, runs: list[tuple[int, int]]
               ) -> list[tuple[int, int, int]]:
        """(address, length, device) per (layer, K/V, run of consecutive blocks), for a
        cache laid out like ours with `num_blocks` blocks starting at `base`."""
        layers2 = self.kv_cache.shape[0] * 2
        seg = self.layout.bytes_per_block // layers2
        return [(base + (lk * num_blocks + start) * seg, n * seg, self._device)
                for lk in range(layers2) for start, n in runs]

    # -- holder ----------------------------------------------------------------------------
    def _hello(self) -> dict:
        # A hello also hands out our agent metadata and where our cache starts.
        md = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"ok": True, "agent": self.agent_name, "metadata": md,
                "base": self.kv_cache.data_ptr(), "blocks": self.kv_cache.shape[2]}

    def _send_blocks(self, conn: socket.socket, blocks: list[int], heads, peer: str,
                     req: PullRequest) -> None:
        # The puller READs the blocks itself; we say the lease is taken and by whom, then
        # drive our agent's progress until the puller's ack arrives (no progress thread:
        # it would spin a core forever; this spins only while a pull is in flight).
        send_msg(conn, {"ok": True, "nbytes": len(blocks) * self.layout.bytes_per_block,
                         "agent": self.agent_name})
        deadline = time.monotonic() + (conn.gettimeout() or 60)
        while not select.select([conn], [], [], 0)[0]:
            if time.monotonic() > deadline:
                raise TimeoutError("the puller never acknowledged")
            self.agent.get_new_notifs()  # runs UCX's progress engine (the agent locks)
            time.sleep(_POLL_S)

    # -- puller ----------------------------------------------------------------------------
    def connect(self, peer: Endpoint, timeout_s: float = 5.0) -> None:
        self._check_layout(peer)
        if peer.address not in self._peers:
            self._handshake(peer, timeout_s)

    def _handshake(self, peer: Endpoint, timeout_s: float) -> tuple[str, int, int]:
        reply = self._say_hello(peer, timeout_s)
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

    def _receive(self, sock: socket.socket, reply: dict, src: list[int], dst: list[int],
                 remaining, peer: Endpoint) -> int:
        n = len(src)
        if n == 0:
            return 0
        known = self._peers.get(peer.address)
        if known is None or known[0] != reply.get("agent"):
            known = self._handshake(peer, remaining())
        agent, base, peer_blocks = known
        if max(src) >= peer_blocks:  # never READ past the cache the holder registered
            raise TransferError(f"blocks {[b for b in src if b >= peer_blocks][:5]} are "
                                f"outside {peer.address}'s {peer_blocks}-block cache")
        runs = paired_runs(src, dst)
        local = self.agent.get_xfer_descs(
            self._descs(self.kv_cache.data_ptr(), self.kv_cache.shape[2],
                        [(d, k) for _, d, k in runs]), self._mem)
        remote = self.agent.get_xfer_descs(
            self._descs(base, peer_blocks, [(s, k) for s, _, k in runs]), self._mem)
        try:
            handle = self.agent.initialize_xfer("READ", local, remote, agent)
        except Exception as err:  # noqa: BLE001 - nixl raises its own types
            raise PeerUnreachableError(f"NIXL cannot read from {peer.address}: {err}") from None
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                remaining()  # raises TransferTimeoutError past the deadline
                time.sleep(_POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise PeerUnreachableError(f"NIXL READ from {peer.address} failed ({state})")
        except TransferError:
            raise
        except Exception as err:  # noqa: BLE001 - a dead peer surfaces as nixl errors
            raise PeerUnreachableError(f"NIXL READ from {peer.address} failed: {err}") \
                from None
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an aborted handle may refuse; it is freed later
                pass
        return n * self.layout.bytes_per_block

    def close(self) -> None:
        super().close()
        if self.agent is not None:
            for name, _, _ in list(self._peers.values()):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass
            try:
                if getattr(self, "_registered", None) is not None:
                    self.agent.deregister_memory(self._registered)
            except Exception:  # noqa: BLE001
                pass
            self.agent = None  # the agent and its UCX workers go with the last reference

