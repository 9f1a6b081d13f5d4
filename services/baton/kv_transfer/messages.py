"""The KV port's requests, typed: what a puller sends a holder over the tcp control plane
(shared by tcp, gloo / nccl and nixl), one pydantic model each, told apart by `op`, framed by
`wire.py`. The holder parses them in `handshake.accept`: a message that does not fit is "a
malformed hello" or "a malformed request" (refused, logged), never a KeyError in a handler.
What depends on the holder's state (the layout, the block range, the lease) is checked
after parsing, in `handshake.py` and the transports. Unknown fields are ignored, so a newer
puller's additions do not break an older holder."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, TypeAdapter

MAX_ID_CHARS = 128
Id = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_ID_CHARS)]
NONCE_PATTERN = r"^[0-9a-f]{32}$"  # secrets.token_hex(16)
Nonce = Annotated[str, StringConstraints(strict=True, pattern=NONCE_PATTERN)]


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    def wire(self) -> dict[str, Any]:
        """The JSON object `wire.send_msg` frames (fields left at None are not sent)."""
        return self.model_dump(exclude_none=True)


class Hello(_Message):
    """A connection's first message, after the magic: who pulls, with which layout, and
    whether it has the KV secret."""

    op: Literal["hello"]
    fingerprint: Any = None  # compared with the holder's: another layout is refused
    peer: Id  # the puller's engine id
    nonce: Nonce  # its fresh nonce for the HMAC challenge
    auth: StrictBool  # whether it has a secret


class InfoRequest(_Message):
    """Ask for the holder's hello (NIXL: its agent metadata); `proof` with a secret."""

    op: Literal["info"] = "info"
    proof: str | None = None


class PullRequest(_Message):
    """Pull blocks `src` of a lease: `heads` (a global KV head range) and `part` ((i, n): the
    i-th of n pulls reading this lease) across tensor-parallel degrees; `group`: the gloo /
    nccl pair group the puller has for this holder; `proof` with a secret."""

    op: Literal["pull"] = "pull"
    lease: Id
    src: list[Any]  # block ids; their range is the holder's to check
    heads: Any = None
    part: Any = None
    group: str | None = None
    proof: str | None = None


class Ack(_Message):
    """The puller has every byte: the holder ends the lease ("pulled")."""

    op: Literal["ack"] = "ack"


KVRequest = Annotated[InfoRequest | PullRequest, Field(discriminator="op")]
REQUEST = TypeAdapter(KVRequest)
