"""Decode pods behind the router: what a decode pod gets, and resuming a stream it dropped.

`DecodeCall` is what the router plans for a decode pod (`router.remote_prefill`): the
client's request, the prompt's token ids and `kv_transfer_params` when a prefill pod ran,
and the pod picked first. Its `body()` is a `common.internal.GenerateRequest`, asking, for a
stream that could be resumed (one prompt, `n` = 1), for `return_token_ids`: the pod's
stream then carries `TokenEvent`s (`event: baton.tokens`) beside plain OpenAI content events.

`StreamTracker` reads that stream on its way to the client without parsing the content
events: it drops the token events (the client sees a plain OpenAI stream) and remembers the
prompt ids, the stream's header (id, object, created, model), the tokens sent and the text
length. A token event names the tokens of the content event that follows it; they count as
sent only once that content event went through (a pod that dies in between did not send
them). If the pod dies mid-stream, `continuation()` is the `GenerateRequest` that makes
another decode pod go on from prompt + tokens sent, with `max_tokens` and `min_tokens`
reduced by what was sent and `ResumeState` so that its usage, id and offsets continue the
same stream; the client sees one stream.

What a resumption cannot keep: a seeded sampler restarts its random sequence (greedy output
is exact), and a stop string that straddles the break is not matched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.common.internal import (
    TOKENS_EVENT,
    Api,
    GenerateRequest,
    KVTransferParams,
    OpenAIBody,
    ResumeState,
    StreamHeader,
    TokenEvent,
)
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.common.responses import ChatChunkChoice, ChatDelta, ResponseChunk, TextChoice, Usage
from baton.router.discovery import Upstream
from baton.router.handover import Handover

_TOKEN_EVENT = b"event: " + TOKENS_EVENT.encode()
_DONE = b"data: [DONE]"
_ERROR = b'data: {"error"'  # an in-band error event, told apart without parsing it


@dataclass(frozen=True)
class DecodeCall:
    api: Api
    request: OpenAIBody  # the client's request, as parsed
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: KVTransferParams | None = None
    peer_prefix: KVTransferParams | None = None  # a peer lends the prompt's prefix
    preferred: Upstream | None = field(default=None, repr=False)  # the decode pod picked first
    prefill_s: float = 0.0  # how long the remote prefill took (0 when local)
    # the lease of kv_transfer_params (or peer_prefix), until a decode pod takes it over
    handover: Handover | None = field(default=None, repr=False)

    @property
    def decision(self) -> str:
        """`remote` when a prefill pod computed the prompt, else `local`."""
        return "remote" if self.kv_transfer_params is not None else "local"

    @property
    def resumable(self) -> bool:
        r = self.request
        if not r.stream or r.n != 1:
            return False
        if self.api == "chat":
            return True
        assert isinstance(r, CompletionRequest)  # the body parsed for api "completions"
        return len(r.prompts()) == 1

    def body(self) -> bytes:
        return GenerateRequest(api=self.api, request=self.request,
                               prompt_token_ids=self.prompt_token_ids,
                               kv_transfer_params=self.kv_transfer_params,
                               peer_prefix=self.peer_prefix,
                               return_token_ids=self.resumable).to_json()


class StreamTracker:
    """One resumable stream's progress, fed on the event loop by the relay."""

    def __init__(self, call: DecodeCall) -> None:
        self.call = call
        self.prompt_ids = call.prompt_token_ids
        self.header: StreamHeader | None = None
        self.sent: list[int] = []
        self.text_len = 0
        self.finished = False  # a finish_reason, an in-band error or [DONE] went out
        self.resumes = 0
        self._pending: list[TokenEvent] = []  # token events whose content has not gone out
        self._buf = b""

    # -- relaying --------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """Whole events of `chunk` (plus what was left of the last one), token events
        dropped. Raises ValueError on a malformed token event."""
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        return b"".join(event + b"\n\n" for event in events if self._public(event))

    def _public(self, event: bytes) -> bool:
        """Takes one event in; True when the client gets it."""
        if event.startswith(_TOKEN_EVENT):
            token = TokenEvent.from_sse(event)
            if token is None:
                raise ValueError(f"a malformed {TOKENS_EVENT} event: {event[:200]!r}")
            self._pending.append(token)
            return False
        if event == _DONE or event.startswith(_ERROR):
            self.finished = True
        elif event.startswith(b"data: "):
            self._commit()  # the content event the pending token events described
        return True

    def _commit(self) -> None:
        for token in self._pending:
            if self.prompt_ids is None:
                self.prompt_ids = token.prompt_token_ids
            if self.header is None:
                self.header = token.header
            self.sent += token.token_ids
            self.text_len += token.text_chars
            self.finished = self.finished or token.finished
        self._pending.clear()

    # -- resuming --------------------------------------------------------------------------
    @property
    def can_resume(self) -> bool:
        return not self.finished and self.prompt_ids is not None and self.header is not None

    def _budget(self) -> int | None:
        r = self.call.request
        if self.call.api == "completions":
            limit = r.max_tokens
        else:
            assert isinstance(r, ChatCompletionRequest)  # the body parsed for api "chat"
            limit = r.max_completion_tokens or r.max_tokens
        return None if limit is None else limit - len(self.sent)

    @property
    def exhausted(self) -> bool:
        left = self._budget()
        return left is not None and left <= 0

    def continuation(self) -> bytes:
        """The GenerateRequest for another decode pod's /internal/generate. What the dead
        stream left unfinished (a partial event, token events without their content) is
        dropped with it."""
        self._buf, self._pending = b"", []
        # only a stream that `can_resume` is continued
        assert self.prompt_ids is not None and self.header is not None
        return GenerateRequest(
            api=self.call.api, request=self._remaining_request(),
            prompt_token_ids=self.prompt_ids + self.sent, return_token_ids=True,
            resume=ResumeState(prompt_tokens=len(self.prompt_ids),
                               completion_tokens=len(self.sent), text_offset=self.text_len,
                               created=self.header.created)).to_json()

    def _remaining_request(self) -> OpenAIBody:
        r, left = self.call.request, self._budget()
        update: dict[str, object] = {}
        if self.call.api == "completions":
            update |= {"max_tokens": left, "echo": False}
        # api "chat" (below) always carries a ChatCompletionRequest
        elif isinstance(r, ChatCompletionRequest) and r.max_completion_tokens is not None:
            update["max_completion_tokens"] = left
        elif r.max_tokens is not None:
            update["max_tokens"] = left
        if r.min_tokens:
            update["min_tokens"] = max(0, r.min_tokens - len(self.sent))
        return r.model_copy(update=update)

    def closing_events(self) -> bytes:
        """When the pod died after the last allowed token but before saying so: the
        finish event (and usage, when asked for) and [DONE]."""
        # only after a stream that `can_resume` was interrupted
        assert self.prompt_ids is not None and self.header is not None
        choices: list[ChatChunkChoice] | list[TextChoice] = (
            [ChatChunkChoice(index=0, delta=ChatDelta(), logprobs=None, finish_reason="length")]
            if self.call.api == "chat" else
            [TextChoice(index=0, text="", logprobs=None, finish_reason="length")])
        events = [ResponseChunk.of(self.header, choices)]
        if self.call.request.include_usage:
            usage = Usage.of(len(self.prompt_ids), len(self.sent))
            events.append(ResponseChunk.of(self.header, [], usage))
        self.finished = True
        return b"".join(e.dump_sse() for e in events) + _DONE + b"\n\n"
