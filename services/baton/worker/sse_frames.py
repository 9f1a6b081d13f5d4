"""The commonest streamed event, pre-framed: one choice's plain text delta.

Nearly every event of a busy stream is the same chunk with a different text: no logprobs,
no finish reason, no tool call or thinking, no usage. Building it as pydantic models and
serialising it costs more of the worker's event loop per token than the socket write does,
and that loop shares the engine thread's GIL. `TextFrames` renders that chunk once per
choice through the same models (`ResponseChunk`) with a marker for its text, keeps the
bytes before and after the marker, and from then on writes `before + text + after`, the
text serialised by the same serialiser pydantic uses (`pydantic_core.to_json`): the bytes
are those of the slow path (`openai_api.Answer.step`), which every other event still takes.
"""

from __future__ import annotations

import uuid

from pydantic_core import to_json

from baton.common.internal import StreamHeader
from baton.common.responses import ChatChunkChoice, ResponseChunk, TextChoice


class TextFrames:
    """One stream's pre-framed text events, one frame per choice index."""

    def __init__(self, header: StreamHeader, chat: bool) -> None:
        self.header, self.chat = header, chat
        self._frames: dict[int, tuple[bytes, bytes]] = {}

    def event(self, index: int, text: str) -> bytes:
        """The SSE event of choice `index`'s `text` delta (chat: `delta.content`;
        completions: `text`), with null logprobs and finish reason."""
        frame = self._frames.get(index)
        if frame is None:
            frame = self._frames[index] = self._frame(index)
        before, after = frame
        return before + to_json(text) + after

    def _frame(self, index: int) -> tuple[bytes, bytes]:
        marker = f"baton-text-{uuid.uuid4().hex}"  # in no id or model name
        choices: list[ChatChunkChoice] | list[TextChoice]
        if self.chat:
            choices = [ChatChunkChoice.model_validate({
                "index": index, "delta": {"content": marker}, "logprobs": None,
                "finish_reason": None})]
        else:
            choices = [TextChoice.model_validate({"index": index, "text": marker,
                                                  "logprobs": None, "finish_reason": None})]
        whole = ResponseChunk.of(self.header, choices).dump_sse()
        before, after = whole.split(to_json(marker))
        return before, after
