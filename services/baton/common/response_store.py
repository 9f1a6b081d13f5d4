"""Stored Responses (`store`, the default): what `GET /v1/responses/{id}` answers and what
`previous_response_id` continues (no torch).

A `StoredResponse` keeps the Response and the conversation before its output (the stored
history it continued, then its own input items), so `conversation()` is everything a next
turn prepends: each turn's record is whole, and a chain never has to be walked. Instructions
are not carried over (OpenAI's rule): each request sends its own.

Two stores behind one interface, both bounded:

- `MemoryResponseStore`: in the process (the router of `baton up`, a worker serving
  /v1/responses itself), least recently used dropped past `max_entries` or `max_bytes`.
- `RedisResponseStore`: in the registry's Redis (`{prefix}:response:{id}`, JSON, a TTL), for
  routers started with `--registry`: any router replica continues any conversation. Redis
  unreachable is a 503.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from baton.common import registry as reg
from baton.common.errors import OpenAIError
from baton.common.responses_api import (
    FunctionCallItem,
    InputItem,
    Item,
    MessageItem,
    ReasoningItem,
    ReasoningPart,
    TextPart,
)
from baton.common.responses_output import OutputMessage, ReasoningOutput, ResponseObject

if TYPE_CHECKING:
    from redis.asyncio import Redis

STORE_VERSION = 1
_T = TypeVar("_T")


class StoredResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: int = STORE_VERSION
    response: ResponseObject
    input: list[InputItem]

    def conversation(self) -> list[Item]:
        """Its input items, then its output as input items (reasoning, messages, calls)."""
        out: list[Item] = list(self.input)
        for item in self.response.output:
            if isinstance(item, ReasoningOutput):
                out.append(ReasoningItem(type="reasoning", id=item.id, status=item.status,
                                         content=[ReasoningPart(type="reasoning_text",
                                                                text=p.text)
                                                  for p in item.content]))
            elif isinstance(item, OutputMessage):
                out.append(MessageItem(role="assistant", id=item.id, status=item.status,
                                       content=[TextPart(type="output_text", text=p.text)
                                                for p in item.content]))
            else:
                out.append(FunctionCallItem(type="function_call", call_id=item.call_id,
                                            name=item.name, arguments=item.arguments,
                                            id=item.id, status=item.status))
        return out

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


class ResponseStore(Protocol):
    """Called on the event loop by the router's and the worker's /v1/responses handlers.
    Raises OpenAIError(503) when the store cannot be reached."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, deleted, expired or evicted)."""

    async def put(self, stored: StoredResponse) -> None:
        """Store (or replace) `stored` under its response's id."""

    async def delete(self, response_id: str) -> bool:
        """Forget it; False when there was nothing to forget."""


class MemoryResponseStore:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"MemoryResponseStore: max_entries={max_entries} and "
                             f"max_bytes={max_bytes} must be >= 1")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()  # JSON, least recent first
        self._bytes = 0

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = self._items.get(response_id)
        if raw is None:
            return None
        self._items.move_to_end(response_id)
        return StoredResponse.model_validate_json(raw)

    async def put(self, stored: StoredResponse) -> None:
        await self.delete(stored.response.id)
        raw = stored.to_json()
        self._items[stored.response.id] = raw
        self._bytes += len(raw)
        while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= len(dropped)

    async def delete(self, response_id: str) -> bool:
        raw = self._items.pop(response_id, None)
        if raw is not None:
            self._bytes -= len(raw)
        return raw is not None

    def __len__(self) -> int:
        return len(self._items)


class RedisResponseStore:
    """`client` is an asyncio Redis client (`registry.redis_client`); this store closes it
    in `close`."""

    def __init__(self, client: Redis, prefix: str = reg.DEFAULT_PREFIX,
                 ttl_s: int = 3600) -> None:
        if ttl_s < 1:
            raise ValueError(f"RedisResponseStore.ttl_s={ttl_s} must be >= 1 second")
        self.client, self.keys, self.ttl_s = client, reg.Keys(prefix), ttl_s

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self._call(self.client.get(self.keys.response(response_id)))
        return None if raw is None else StoredResponse.model_validate_json(raw)

    async def put(self, stored: StoredResponse) -> None:
        await self._call(self.client.set(self.keys.response(stored.response.id),
                                         stored.to_json(), ex=self.ttl_s))

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call(self.client.delete(self.keys.response(response_id))))

    async def close(self) -> None:
        await self.client.aclose()

    @staticmethod
    async def _call(pending: Awaitable[_T]) -> _T:
        from redis.exceptions import RedisError

        try:
            return await pending
        except (RedisError, OSError) as err:
            raise OpenAIError(503, f"the response store (Redis) is unreachable: {err}",
                              code="store_unavailable", headers={"Retry-After": "1"}) from None
