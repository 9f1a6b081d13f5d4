"""The tensor-parallel KV control wire, typed: what rank 0 (`kv_connector/tp_ranks.py`) tells
a follower's KV transport (`runner/tp_kv.py`) in `tp_wire.Control` frames, and what the
follower answers as JSON lines on its stdout. One pydantic model per message, told apart by
`op`; both sides parse with the adapters below, so a malformed message is a validation error
naming the field, not a KeyError deep in a handler."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from baton.common.internal import KVEndpointInfo


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- rank 0 -> follower --------------------------------------------------------------------
class KVStart(_Message):
    """Start this rank's tcp transport under the engine's id."""

    op: Literal["kv_start"] = "kv_start"
    engine_id: str


class KVHold(_Message):
    """A copy of the lease rank 0 just made: the same id, blocks and TTL."""

    op: Literal["hold"] = "hold"
    lease: str
    blocks: list[int]
    ttl: float


class KVRelease(_Message):
    """Rank 0's lease ended unpulled: end this rank's copy."""

    op: Literal["release"] = "release"
    lease: str


class KVPull(_Message):
    """Pull this rank's heads of a lease from the holder's ranks (`peers`: their
    endpoints), answered by a `KVPulled` with the same `tag`."""

    op: Literal["pull"] = "pull"
    tag: str
    lease: str
    peers: list[KVEndpointInfo]
    src: list[int]
    dst: list[int]
    timeout: float


KVControl = Annotated[KVStart | KVHold | KVRelease | KVPull, Field(discriminator="op")]
CONTROL = TypeAdapter(KVControl)


# -- follower -> rank 0 --------------------------------------------------------------------
class KVStarted(_Message):
    """The transport is up (`endpoint`: where it serves), or could not start (`error`)."""

    op: Literal["kv_started"] = "kv_started"
    endpoint: KVEndpointInfo | None = None
    error: str | None = None


class KVPulled(_Message):
    """A `KVPull` ended: `ok`, else the error's class name (`kind`) and text."""

    op: Literal["pulled"] = "pulled"
    tag: str | None
    ok: bool
    kind: str = ""
    error: str = ""
    bytes: int = 0


class KVReleased(_Message):
    """This rank's copy of a lease ended (pulled, expired, released)."""

    op: Literal["released"] = "released"
    lease: str
    reason: str


KVReply = Annotated[KVStarted | KVPulled | KVReleased, Field(discriminator="op")]
REPLY = TypeAdapter(KVReply)
