"""The Responses API on the router: `POST /v1/responses` over the chat path, and the stored
responses (`GET` / `DELETE /v1/responses/{id}`).

A Responses request becomes a chat completion (`common.responses_turn.Turn`) that the
router routes like any chat request: the same routing context, remote prefill on a prefill
pod, retries, and a decode stream resumed on another decode pod; workers see only chat.
The answer is turned into a Response here: a whole body at once (`finish`), a stream event
by event as the relay writes it (the turn's `ResponsesFormat` is the client side's
`EventRewriter`), so a resumed stream is still one Responses stream. The store is the
router's (`common.response_store`): in the process, or in the registry's Redis so that any
router replica continues any conversation.
"""

from __future__ import annotations

from typing import cast

from aiohttp import web

from baton.common import registry as reg
from baton.common.response_store import MemoryResponseStore, RedisResponseStore, ResponseStore
from baton.common.responses_turn import Turn, not_found, stored
from baton.router.settings import RouterSettings

CHAT_PATH = "/v1/chat/completions"  # where a turn's chat request goes


def make_store(settings: RouterSettings) -> ResponseStore:
    """The registry's Redis when there is one (shared by every router replica), else the
    process's memory."""
    if settings.registry_url is not None:
        return RedisResponseStore(reg.redis_client(settings.registry_url),
                                  settings.registry_prefix, settings.response_ttl_s)
    return MemoryResponseStore(settings.response_store_entries)


class ResponsesRoute:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def close(self) -> None:
        if isinstance(self.store, RedisResponseStore):
            await self.store.close()

    async def start(self, body: bytes) -> Turn:
        return await Turn.start(body, self.store)

    async def finish(self, turn: Turn, response: web.StreamResponse) -> web.StreamResponse:
        """The client's answer once the chat answer is in: a whole chat body becomes the
        Response (an error stays as it is); a stream was rewritten as it went. Keeps the
        response in the store."""
        if not turn.request.stream and response.status == 200:
            # cast: the relay builds whole answers from bytes
            turn.format.whole(cast(bytes, cast(web.Response, response).body))
            response = web.json_response(turn.format.response.dump())
        await turn.keep(self.store)
        return response

    def add_routes(self, routes: web.UrlDispatcher) -> None:
        routes.add_get("/v1/responses/{response_id}", self.get)
        routes.add_delete("/v1/responses/{response_id}", self.delete)

    async def get(self, request: web.Request) -> web.Response:
        found = await stored(self.store, request.match_info["response_id"], "response_id")
        return web.json_response(found.response.dump())

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not await self.store.delete(response_id):
            raise not_found(response_id, "response_id")
        return web.json_response({"id": response_id, "object": "response", "deleted": True})
