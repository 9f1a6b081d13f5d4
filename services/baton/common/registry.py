"""The worker registry in Redis: the keys, the records and the events (docs/design.md §6).

Workers write, routers read. Everything lives under one prefix (default `baton`, one per
deployment sharing a Redis):

    {prefix}:worker:{id}      the worker's record (JSON), SET with a TTL and refreshed by
                              every heartbeat: a worker that stops disappears by itself
    {prefix}:blocks:{id}      a SET of the KV block hashes it holds (hex), same TTL; a
                              block its offload tiers hold is "h:<hex>" (host) or
                              "d:<hex>" (disk), so one block may appear in several
    {prefix}:blockseq:{id}    the number of the last block event folded into that set
    {prefix}:events           the pub/sub channel every change is announced on
    {prefix}:response:{id}    a stored Response of /v1/responses (routers write and read
                              it, with a TTL; `common.response_store`)

Routers subscribe to the channel (one connection each, nothing polled) and read the keys
only to catch up: at start, after a reconnect, or when a worker's block events skip a
number. A worker changes its block set and the sequence number in one MULTI with the
PUBLISH, so a snapshot read in one MULTI names the event it includes, and the events after
it apply on top in order. Messages carry a version field; unknown versions are dropped.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from baton.common.roles import Role

if TYPE_CHECKING:
    from redis.asyncio import Redis

WIRE_VERSION = 1
DEFAULT_PREFIX = "baton"


class LoadReport(BaseModel):
    """A worker's role, model and load: what `/load` answers, what a router's health check
    and registry view read, and the fields of every heartbeat's `WorkerRecord`. Unknown
    fields are ignored and missing ones take these defaults (older and newer peers)."""

    model_config = ConfigDict(extra="ignore")

    role: Role  # on the wire its name: "both", "prefill" or "decode"
    model: str  # the primary served name (what responses report)
    # Every name it serves (`--served-model-name a b`); empty from older workers: `model`.
    models: list[str] = Field(default_factory=list)
    ready: bool = True
    running: int = 0
    waiting: int = 0
    max_waiting: int | None = None
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16  # tokens per KV block: the unit of the published hashes
    max_model_len: int | None = None
    # LoRA adapters (`engine.lora`): every one it serves (a request may name it as its
    # model), and those it holds a host copy of (no disk read before serving them)
    lora_adapters: list[str] = Field(default_factory=list)
    lora_loaded: list[str] = Field(default_factory=list)
    # each adapter's KV hash root (`hashing.lora_root_hash`, hex): its requests' block
    # hashes chain from it, so the router hashes their prompts as the engine does
    lora_roots: dict[str, str] = Field(default_factory=dict)


class WorkerRecord(LoadReport):
    """What a worker says about itself in every heartbeat: its load report, and where and
    how to reach it."""

    v: int = WIRE_VERSION
    id: str  # this process: a restart under the same address is a new id
    url: str  # where routers reach its HTTP API
    kv_transport: str | None = None  # how its KV is pulled (prefill pods), or None
    ttl_s: float = Field(3.0, gt=0)


class Keys:
    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or ":" in prefix or " " in prefix:
            raise ValueError(f"registry prefix {prefix!r}: a non-empty word without ':'")
        self.prefix = prefix
        self.channel = f"{prefix}:events"
        self.worker_pattern = f"{prefix}:worker:*"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def blocks(self, worker_id: str) -> str:
        return f"{self.prefix}:blocks:{worker_id}"

    def blockseq(self, worker_id: str) -> str:
        return f"{self.prefix}:blockseq:{worker_id}"

    def response(self, response_id: str) -> str:
        """A stored Response (`common.response_store`), JSON with a TTL."""
        return f"{self.prefix}:response:{response_id}"

    def id_of(self, worker_key: str) -> str:
        return worker_key.rsplit(":", 1)[1]


# -- events on the channel ---------------------------------------------------------------
def heartbeat(record: WorkerRecord) -> str:
    return json.dumps({"v": WIRE_VERSION, "kind": "heartbeat",
                       "record": record.model_dump()})


def leave(worker_id: str) -> str:
    return json.dumps({"v": WIRE_VERSION, "kind": "leave", "id": worker_id})


def blocks(worker_id: str, seq: int, added: list[str], removed: list[str],
           reset: bool = False) -> str:
    """Block event `seq` of a worker. `reset`: the set was replaced by `added` (a
    snapshot after a reconnect, or the cache was cleared)."""
    return json.dumps({"v": WIRE_VERSION, "kind": "blocks", "id": worker_id, "seq": seq,
                       "added": added, "removed": removed, "reset": reset})


# An event is a few KB (a heartbeat; a block event of a few hundred hashes); bigger is junk.
MAX_EVENT_BYTES = 1 << 20


def parse_event(data: bytes | str) -> dict[str, Any] | None:
    """A decoded event (JSON; a heartbeat's `record` a WorkerRecord), or None for a message
    of another version or shape, or over `MAX_EVENT_BYTES`: whatever is published on the
    channel, None or a well-formed event, never an exception."""
    if len(data) > MAX_EVENT_BYTES:
        return None
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(msg, dict) or msg.get("v") != WIRE_VERSION:
        return None
    kind = msg.get("kind")
    if kind == "heartbeat":
        try:
            msg["record"] = WorkerRecord.model_validate(msg.get("record"))
        except ValueError:
            return None
        return msg
    if not isinstance(msg.get("id"), str):
        return None
    if kind == "leave" or (kind == "blocks" and _block_event(msg)):
        return msg
    return None


def _block_event(msg: dict[str, Any]) -> bool:
    """Whether `msg` has a block event's fields with their types."""
    return (type(msg.get("seq")) is int and isinstance(msg.get("reset", False), bool)
            and all(isinstance(msg.get(k), list)
                    and all(isinstance(h, str) for h in msg[k]) for k in ("added", "removed")))


def hash_hex(block_hash: int) -> str:
    return format(block_hash, "x")


# Where a worker holds a published block: its device KV pool, or the offload tiers under it
# (`engine.kv_tier`): host memory, local disk. Each tier's blocks are published apart.
DEVICE, HOST, DISK = "", "h", "d"
TIERS = (DEVICE, HOST, DISK)


def member(block_hash: str, tier: str = DEVICE) -> str:
    """The block set's member for hex hash `block_hash` held in `tier`."""
    return f"{tier}:{block_hash}" if tier else block_hash


def redis_client(url: str, timeout_s: float = 2.0) -> Redis:
    """An asyncio Redis client for `url` (redis://host:port/db) with bounded timeouts, so
    that an unreachable Redis is an error, never a hang."""
    import redis.asyncio as aioredis

    client: Redis = aioredis.Redis.from_url(  # from_url has no return annotation
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        health_check_interval=0)
    return client
