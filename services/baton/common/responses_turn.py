"""One Responses request served as a chat completion, on the router or on a worker (no
torch): the request parsed, the conversation of its `previous_response_id` read from the
store, the chat body that answers it, its `ResponsesFormat`, and the response kept in the
store once it is done.

    turn = await Turn.start(body, store)     # 400 / 404 as OpenAIError
    ... serve turn.chat_body as /v1/chat/completions, through turn.format ...
    await turn.keep(store)                   # a done, not failed response with `store`
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from baton.common.errors import OpenAIError
from baton.common.parsing import parse_request_off_loop
from baton.common.protocol import ChatCompletionRequest
from baton.common.response_store import ResponseStore, StoredResponse
from baton.common.responses_api import Item, ResponsesRequest
from baton.common.responses_format import ResponsesFormat


@dataclass
class Turn:
    request: ResponsesRequest
    history: list[Item]  # the stored conversation it continues
    chat: ChatCompletionRequest  # what answers it
    chat_body: bytes  # `chat` as JSON
    format: ResponsesFormat = field(init=False)

    def __post_init__(self) -> None:
        self.format = ResponsesFormat(self.request)

    @classmethod
    async def start(cls, body: bytes, store: ResponseStore) -> Turn:
        """Raises OpenAIError: 400 for a bad body (or a conversation the chat request
        refuses), 404 for an unknown `previous_response_id`, 503 for a store away."""
        request = await parse_request_off_loop(ResponsesRequest, body)
        history: list[Item] = []
        if request.previous_response_id is not None:
            history = (await stored(store, request.previous_response_id,
                                    "previous_response_id")).conversation()
        chat_body = json.dumps(request.chat_body(history)).encode()
        chat = await parse_request_off_loop(ChatCompletionRequest, chat_body)
        return cls(request, history, chat, chat_body)

    async def keep(self, store: ResponseStore) -> None:
        """Store the response, when it is done, did not fail, and `store` is true."""
        fmt = self.format
        if fmt.done and fmt.response.status != "failed" and self.request.store:
            await store.put(StoredResponse(
                response=fmt.response, input=[*self.history, *self.request.input_items()]))


async def stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    """The stored response, or a 404 OpenAIError naming `param`."""
    found = await store.get(response_id)
    if found is None:
        raise not_found(response_id, param)
    return found


def not_found(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"no response with id {response_id!r}: it was never stored "
                            "(store false), or it was deleted or has expired",
                       param=param, code="response_not_found")
