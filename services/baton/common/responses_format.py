"""A chat answer turned into a Responses answer, whole or streamed (no torch).

A Responses request is served as the chat completion `ResponsesRequest.chat_body` makes
(`common.responses_api`); its answer comes back here:

- whole: `ResponsesFormat.whole(chat body)` -> the `Response`: a reasoning model's
  thinking (`reasoning_content`) as a `reasoning` item with one `reasoning_text` part, the
  message's text as a `message` item with one `output_text` part, each tool call as a
  `function_call` item (`call_id`: the chat call's id), usage renamed, `status` from the finish reason
  (`length` -> `incomplete`, reason `max_output_tokens`).
- streamed: `ResponsesFormat.feed(chat SSE bytes)` -> Responses SSE events, in the order
  OpenAI sends them: `response.created`, `response.in_progress`; per reasoning item
  `output_item.added`, `content_part.added`, `reasoning_text.delta`…, `reasoning_text.done`,
  `content_part.done`, `output_item.done`; per message
  `output_item.added`, `content_part.added`, `output_text.delta`…, `output_text.done`,
  `content_part.done`, `output_item.done`; per call `output_item.added`,
  `function_call_arguments.delta`…, `.done`, `output_item.done`; then
  `response.completed` (or `response.incomplete`) with the usage. The chat stream's error
  event (or `failed(error)`, when the stream broke) becomes an `error` event and
  `response.failed`. Bytes may arrive cut anywhere: whole chat events are read.

The router feeds the chat stream it relays (after dropping its `baton.tokens` events), a
worker serving /v1/responses itself feeds its own; both keep `response` for the store.
"""

from __future__ import annotations

import json

from baton.common.errors import OpenAIError
from baton.common.responses import (
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ResponseChunk,
    Usage,
)
from baton.common.responses_api import ResponsesRequest
from baton.common.responses_output import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallOutput,
    IncompleteDetails,
    ItemEvent,
    ItemStatus,
    LifecycleEvent,
    OutputMessage,
    OutputText,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    new_id,
)

_DONE = b"data: [DONE]"


class ResponsesFormat:
    """One Responses answer; `response` is where it stands (whole once `done`)."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.response = ResponseObject.start(request, request.model)
        self.done = False  # the terminal event went out (or the whole answer was made)
        self._seq = 0
        self._opened = False
        self._buf = b""
        self._message: OutputMessage | None = None  # the message item being streamed
        self._reasoning: ReasoningOutput | None = None  # the reasoning item being streamed
        self._calls: dict[int, FunctionCallOutput] = {}  # open calls by the chat's index
        self._finish: str | None = None
        self._usage: Usage | None = None  # a stream's, from its usage chunk

    # -- whole -----------------------------------------------------------------------------
    def whole(self, body: bytes) -> ResponseObject:
        """The Response made from a chat completion's JSON body."""
        chat = ChatCompletion.model_validate_json(body)
        choice, r = chat.choices[0], self.response
        r.model = chat.model
        self._finish = choice.finish_reason
        item_status = self._item_status
        if choice.message.reasoning_content:
            r.output.append(ReasoningOutput(id=new_id("rs"), status=item_status, content=[
                ReasoningText(text=choice.message.reasoning_content)]))
        if choice.message.content:
            r.output.append(OutputMessage(id=new_id("msg"), status=item_status,
                                          content=[OutputText(text=choice.message.content)]))
        for call in choice.message.tool_calls or ():
            assert call.id is not None and call.function.name is not None  # a whole call
            r.output.append(FunctionCallOutput(
                id=new_id("fc"), status=item_status, call_id=call.id,
                name=call.function.name, arguments=call.function.arguments or ""))
        self._end_status(chat.usage)
        self.done = True
        return r

    # -- streamed --------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """The Responses events of the chat stream's whole events in `chunk` (and what was
        left of the last one)."""
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        return b"".join(self._event(e) for e in events)

    def failed(self, error: OpenAIError) -> bytes:
        """The end of a stream that broke: an `error` event and `response.failed`."""
        return self._fail(error.code or error.type, error.message, error.param)

    def _event(self, raw: bytes) -> bytes:
        if self.done or not raw.startswith(b"data: "):
            return b""
        if raw == _DONE:
            return self._opening() + self._close_items() + self._end()
        data = json.loads(raw[6:])
        if "error" in data:
            error = data["error"]
            return self._fail(error.get("code") or error.get("type") or "server_error",
                              str(error.get("message")), error.get("param"))
        chunk = ResponseChunk.model_validate(data)
        self.response.model = chunk.model
        out = self._opening()
        if chunk.usage is not None:
            self._usage = chunk.usage
        for choice in chunk.choices:
            if not isinstance(choice, ChatChunkChoice):
                raise ValueError(f"not a chat stream's event: {raw[:200]!r}")
            out += self._delta(choice.delta)
            if choice.finish_reason is not None:
                self._finish = choice.finish_reason
                out += self._close_items()
        return out

    def _opening(self) -> bytes:
        if self._opened:
            return b""
        self._opened = True
        return (self._emit(LifecycleEvent, type="response.created", response=self.response)
                + self._emit(LifecycleEvent, type="response.in_progress",
                             response=self.response))

    def _delta(self, delta: ChatDelta) -> bytes:
        out = b""
        if delta.reasoning_content:
            out += self._thinking(delta.reasoning_content)
        if delta.content:
            out += self._text(delta.content)
        for call in delta.tool_calls or ():
            index = call.index or 0
            if call.id is not None:
                out += (self._close_reasoning() + self._close_message()
                        + self._open_call(index, call.id, call.function.name or ""))
            if call.function.arguments and index in self._calls:
                item = self._calls[index]
                item.arguments += call.function.arguments
                out += self._emit(ArgumentsDeltaEvent, item_id=item.id,
                                  output_index=self._index(item),
                                  delta=call.function.arguments)
        return out

    def _text(self, text: str) -> bytes:
        out = self._close_reasoning()
        if self._message is None:
            self._message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
            out += self._open_part(self._message, OutputText(text=""))
        self._message.content[0].text += text
        return out + self._emit(TextDeltaEvent, item_id=self._message.id,
                                output_index=self._index(self._message), delta=text)

    def _thinking(self, text: str) -> bytes:
        out = b""
        if self._reasoning is None:
            self._reasoning = ReasoningOutput(id=new_id("rs"), status="in_progress",
                                              content=[])
            out += self._open_part(self._reasoning, ReasoningText(text=""))
        self._reasoning.content[0].text += text
        return out + self._emit(ReasoningDeltaEvent, item_id=self._reasoning.id,
                                output_index=self._index(self._reasoning), delta=text)

    def _open_part(self, item: OutputMessage | ReasoningOutput,
                   part: OutputText | ReasoningText) -> bytes:
        """An item of one text part starts: it is added, then its empty part."""
        out = self._added(item) + self._emit(
            ContentPartEvent, type="response.content_part.added", item_id=item.id,
            output_index=self._index(item), part=part)
        item.content.append(part.model_copy())  # type: ignore[arg-type]  # its own kind
        return out

    def _open_call(self, index: int, call_id: str, name: str) -> bytes:
        item = FunctionCallOutput(id=new_id("fc"), status="in_progress", call_id=call_id,
                                  name=name, arguments="")
        self._calls[index] = item
        return self._added(item)

    def _added(self, item: OutputMessage | FunctionCallOutput | ReasoningOutput) -> bytes:
        self.response.output.append(item)
        return self._emit(ItemEvent, type="response.output_item.added",
                          output_index=self._index(item), item=item)

    def _close_message(self) -> bytes:
        message, self._message = self._message, None
        return self._close_part(message, TextDoneEvent) if message is not None else b""

    def _close_reasoning(self) -> bytes:
        reasoning, self._reasoning = self._reasoning, None
        return self._close_part(reasoning, ReasoningDoneEvent) if reasoning is not None \
            else b""

    def _close_part(self, item: OutputMessage | ReasoningOutput,
                    done: type[TextDoneEvent] | type[ReasoningDoneEvent]) -> bytes:
        """The end of an item of one text part: its text, its part, the item."""
        item.status = self._item_status
        at, part = self._index(item), item.content[0]
        return (self._emit(done, item_id=item.id, output_index=at, text=part.text)
                + self._emit(ContentPartEvent, type="response.content_part.done",
                             item_id=item.id, output_index=at, part=part)
                + self._emit(ItemEvent, type="response.output_item.done", output_index=at,
                             item=item))

    def _close_items(self) -> bytes:
        out = self._close_reasoning() + self._close_message()
        for item in self._calls.values():
            item.status = self._item_status
            at = self._index(item)
            out += (self._emit(ArgumentsDoneEvent, item_id=item.id, output_index=at,
                               name=item.name, arguments=item.arguments)
                    + self._emit(ItemEvent, type="response.output_item.done",
                                 output_index=at, item=item))
        self._calls.clear()
        return out

    def _end(self) -> bytes:
        self._end_status(self._usage)
        self.done = True
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            self.response.status, "response.failed")
        return self._emit(LifecycleEvent, type=kind, response=self.response)

    def _fail(self, code: str, message: str, param: str | None) -> bytes:
        out = self._opening()
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        self.done = True
        return (out + self._emit(ErrorEvent, code=code, message=message, param=param)
                + self._emit(LifecycleEvent, type="response.failed", response=self.response))

    # -- parts -----------------------------------------------------------------------------
    @property
    def _item_status(self) -> ItemStatus:
        return "incomplete" if self._finish == "length" else "completed"

    def _end_status(self, usage: Usage | None) -> None:
        """The finished response's status (and usage): `length` is OpenAI's
        `max_output_tokens`; an engine that aborted or failed the request fails it."""
        r = self.response
        if self._finish == "length":
            r.status, r.incomplete_details = "incomplete", IncompleteDetails(
                reason="max_output_tokens")
        elif self._finish in ("abort", "error"):
            r.status, r.error = "failed", ResponseError(
                code="server_error", message=f"the generation ended with {self._finish!r}")
        else:
            r.status = "completed"
        if usage is not None:
            details = usage.prompt_tokens_details
            r.usage = ResponseUsage.of(usage.prompt_tokens, usage.completion_tokens,
                                       details.cached_tokens if details is not None else 0)

    def _index(self, item: OutputMessage | FunctionCallOutput | ReasoningOutput) -> int:
        return next(i for i, it in enumerate(self.response.output) if it is item)

    def _emit(self, kind: type[ResponseEvent], **fields: object) -> bytes:
        event = kind.model_validate({"sequence_number": self._seq, **fields})
        self._seq += 1
        return event.sse()
