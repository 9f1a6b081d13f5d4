"""`POST /v1/responses` on a worker called directly (`baton serve` answers the same /v1 API
as the router), and its stored responses (`GET` / `DELETE /v1/responses/{id}`).

As on the router, a Responses request is served as the chat request of its turn
(`common.responses_turn`) through this worker's own chat pipeline, and its answer turned
into a Response (`common.responses_format`): a whole body at once, a stream event by event.
The store is this process's (`MemoryResponseStore`): `previous_response_id` continues only
what this worker answered. Behind a router, workers never get /v1/responses: the router
sends them chat.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from baton.common.response_store import MemoryResponseStore, ResponseStore
from baton.common.responses_turn import Turn, not_found, stored
from baton.worker.pipeline import Call
from baton.worker.state import WorkerState


def install_responses_routes(app: FastAPI, state: WorkerState) -> None:
    store = MemoryResponseStore()

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        turn = await Turn.start(await request.body(), store)
        answer = await state.require_pipeline().serve(request, Call("chat", turn.chat))
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _events(turn, answer.body_iterator, store)
            return answer
        turn.format.whole(bytes(answer.body))
        await turn.keep(store)
        return JSONResponse(turn.format.response.dump())

    @app.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> JSONResponse:
        found = await stored(store, response_id, "response_id")
        return JSONResponse(found.response.dump())

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        if not await store.delete(response_id):
            raise not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _events(turn: Turn, chat: AsyncIterable[str | bytes | memoryview],
                  store: ResponseStore) -> AsyncIterator[bytes]:
    """The chat stream's events as Responses events; the response kept once it ends."""
    async for chunk in chat:
        out = turn.format.feed(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
        if out:
            yield out
    await turn.keep(store)
