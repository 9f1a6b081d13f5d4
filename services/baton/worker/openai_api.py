"""OpenAI response bodies of /v1/chat/completions and /v1/completions, streamed or whole.

`OpenAIFormat` (one per worker) makes one `Answer` per HTTP request; the answer folds the
serving side's updates (`serving.Update`: a job and its engine output batch) into one
`Choice` per choice, and turns them into SSE events (`events`) or one JSON body (`body`).
Formatting reads the updates only; it never calls the serving side.

An error after the stream has started cannot change the status code any more: it is sent as
one `data: {"error": ...}` event followed by `data: [DONE]`, as vLLM does.

A chat choice whose tool calls are read (`tool_calls.py`) shows its calls as `tool_calls`
deltas and its other text as content; it finishes with `tool_calls` when it made calls.
Completions with `echo` and `logprobs` show the prompt's logprobs (the first token's None)
before the output's, with the echoed prompt in the choice's first content event. With
`stream_options.continuous_usage_stats`, every chunk carries the usage so far.

`Internal` carries what only a router asks of a decode pod's /internal/generate:

- `return_token_ids`: `common.internal.TokenEvent`s beside the content events, so the
  router can resume the stream elsewhere if this pod dies. The first one, before any
  content, has the prompt's ids and the stream's header; then each engine update that
  brings tokens (or a content event) gets one, written just before its content event.
- `resume`: a stream another decode pod started, whose usage, id, `created` and text
  offsets this one continues instead of starting a new stream.
- `timing`: the router's part of the TTFT when the client asked for a breakdown (header
  `X-Baton-Timing`): the answer then has `baton_ttft` (seconds: router queue, prefill,
  decode queue, first token, and their sum `total_s`; plus the KV pull `transfer_s`, which
  is off the TTFT path: a decode pod streams the prefill's first token before it pulls) at
  the top level of a whole body, or on a stream's finishing events.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar, cast

from baton.common.internal import Api, OpenAIBody, ResumeState, StreamHeader, TokenEvent
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.common.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    Completion,
    OpenAIResponse,
    ResponseChunk,
    TextChoice,
    TTFTBreakdown,
    Usage,
)
from baton.engine.outputs import EngineOutput
from baton.engine.sampler import TokenLogprobs
from baton.worker.logprobs import TokenTexts, joined
from baton.worker.reasoning import ReasoningFormat, ThinkingSplitter, chat_deltas, chat_message
from baton.worker.serving import FirstToken, Job, Update, engine_error
from baton.worker.sse_frames import TextFrames
from baton.worker.tool_calls import ChoiceTools, ToolFormat

SSE_DONE = b"data: [DONE]\n\n"
_Timed = TypeVar("_Timed", bound=OpenAIResponse)


@dataclass(frozen=True)
class Internal:
    return_token_ids: bool = False
    resume: ResumeState | None = None
    timing: dict[str, float] | None = None  # the router's part of the TTFT; None: not asked


PUBLIC = Internal()


@dataclass
class Choice:
    """One choice's text, tokens and logprobs so far, and what the latest update added."""

    index: int
    echo: str = ""  # completions with `echo`: the prompt's text, before the output
    text_offset: int = 0  # characters before this choice's output (echo, a resumed stream)
    tools: ChoiceTools | None = None  # chat with tool calls to read
    thinking: ThinkingSplitter | None = None  # chat of a reasoning model that thinks
    echo_pending: bool = False  # the echo goes out with the first update (prompt logprobs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    cached: int = 0  # prompt tokens served from the prefix cache
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, batch: list[EngineOutput]) -> None:
        """Fold in one batch of this choice's engine outputs; `new_*` then hold its part."""
        self.new_text = "".join(out.new_text for out in batch)
        self.new_token_ids = [t for out in batch for t in out.new_token_ids]
        self.new_logprobs = [lp for out in batch for lp in out.new_logprobs or ()]
        self.text += self.new_text
        self.num_tokens += len(self.new_token_ids)
        self.logprobs += self.new_logprobs
        self.cached = batch[-1].num_cached_tokens or self.cached
        self.finish_reason = batch[-1].finish_reason
        for out in batch:
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs

    @property
    def new_text_offset(self) -> int:
        """The text offset of the latest update's first token (completions logprobs)."""
        return self.text_offset + len(self.text) - len(self.new_text)


class OpenAIFormat:
    """One worker's OpenAI formatting: its model name, its tokenizer's token texts, its
    tool-call format (`tool_parser`: `--tool-call-parser`) and reasoning format
    (`reasoning_parser`: `--reasoning-parser`)."""

    def __init__(self, tokenizer, model_name: str, tool_parser: str = "auto",
                 reasoning_parser: str = "none") -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.texts = TokenTexts(tokenizer)
        # No tokenizer (--skip-tokenizer-init): no template, and chat is refused anyway.
        self.tools = ToolFormat(tool_parser, getattr(tokenizer, "chat_template", None))
        self.reasoning = ReasoningFormat(reasoning_parser, tokenizer)

    def answer(self, api: Api, request: OpenAIBody, response_id: str,
               prompts: list[list[int]], num_choices: int, internal: Internal) -> Answer:
        """The answer to one request of `prompts` (already tokenised) with `num_choices`
        choices, `num_choices // len(prompts)` per prompt, in prompt order."""
        resume = internal.resume
        created = resume.created if resume is not None and resume.created else int(time.time())
        kind = "chat.completion.chunk" if api == "chat" else "text_completion"
        header = StreamHeader(id=response_id, object=kind, created=created,
                              model=self.model_name)
        per_prompt = num_choices // len(prompts)
        offset = resume.text_offset if resume is not None else 0
        # cast: api "completions" carries a CompletionRequest (GenerateRequest checks it)
        prompt_lps = (api == "completions"
                      and cast(CompletionRequest, request).prompt_logprobs is not None)
        choices = []
        for i in range(num_choices):
            echo = self._echo(api, request, prompts, i // per_prompt)
            choices.append(Choice(i, echo, len(echo) + offset,
                                  echo_pending=prompt_lps and resume is None))
            if api == "chat":
                self._read_chat(choices[-1], request, prompts, resume)
        return Answer(self, api, request, header, prompts, choices, internal)

    def _read_chat(self, choice: Choice, request: OpenAIBody, prompts: list[list[int]],
                   resume: ResumeState | None) -> None:
        """A chat choice's readers of its tool calls and thinking; a resumed stream's first
        read (silently) the text the interrupted pod sent, so they go on where they were."""
        assert isinstance(request, ChatCompletionRequest)  # only called for api "chat"
        choice.tools = tools = self.tools.choice_tools(request)
        choice.thinking = thinking = self.reasoning.splitter(request)
        if (tools or thinking) and resume is not None and resume.completion_tokens:
            skip = request.skip_special_tokens and not self.tools.keeps_special_tokens(
                request)
            sent = prompts[0][-resume.completion_tokens:]
            chat_deltas(self.tokenizer.decode(sent, skip_special_tokens=skip), False, tools,
                        thinking)

    def _echo(self, api: Api, request: OpenAIBody, prompts: list[list[int]], p: int) -> str:
        if api != "completions":
            return ""
        assert isinstance(request, CompletionRequest)  # the body of api "completions"
        if not request.echo:
            return ""
        original = request.prompts()[p]
        if isinstance(original, str):
            return original
        return self.tokenizer.decode(prompts[p]) if self.tokenizer is not None else ""


class Answer:
    """One request's response, built up from its updates."""

    def __init__(self, fmt: OpenAIFormat, api: Api, request: OpenAIBody,
                 header: StreamHeader, prompts: list[list[int]], choices: list[Choice],
                 internal: Internal) -> None:
        self.texts = fmt.texts
        self.api, self.request, self.header = api, request, header
        self.prompts, self.choices, self.internal = prompts, choices, internal
        self.chat = api == "chat"
        self.want_logprobs = bool(request.logprobs) if self.chat \
            else request.logprobs is not None
        self.continuous_usage = request.continuous_usage
        self.frames = TextFrames(header, self.chat)  # the plain text deltas' events
        self.first_token: FirstToken | None = None  # the first choice's to get a token
        self.kv_transfer_s: float | None = None

    def add(self, job: Job, batch: list[EngineOutput]) -> Choice:
        """Fold one update into its choice (and the TTFT parts); the choice it changed."""
        choice = self.choices[job.index]
        choice.add(batch)
        if self.first_token is None:
            self.first_token = job.first_token
        if choice.finish_reason is not None and job.kv_transfer_s is not None:
            self.kv_transfer_s = job.kv_transfer_s
        return choice

    # -- whole -----------------------------------------------------------------------------
    def body(self) -> dict:
        """The non-streaming response body, once every choice finished."""
        h = self.header
        whole: ChatCompletion | Completion
        if self.chat:
            whole = ChatCompletion(id=h.id, object="chat.completion", created=h.created,
                                   model=h.model, usage=self.usage(),
                                   choices=[self._whole_message(c) for c in self.choices])
        else:
            echoed = self.internal.resume is None
            whole = Completion(id=h.id, object="text_completion", created=h.created,
                               model=h.model, usage=self.usage(), choices=[
                                   TextChoice.model_validate({
                                       "index": c.index, "text": c.echo + c.text,
                                       "logprobs": self._text_logprobs(
                                           c, c.logprobs, c.text_offset, echoed),
                                       "finish_reason": c.finish_reason})
                                   for c in self.choices])
        return self._timed(whole).dump()

    # -- streamed --------------------------------------------------------------------------
    def opening(self) -> bytes:
        """What a stream starts with, before any engine output: the header token event
        (with `return_token_ids`), then chat's role chunks or completions' echo chunks
        (and, for a router, an empty first chunk). A resumed stream's client has those."""
        out = b""
        if self.internal.resume is not None:
            if self.internal.return_token_ids:
                out += TokenEvent(prompt_token_ids=self.prompts[0], header=self.header).sse()
            return out
        if self.internal.return_token_ids:  # its chars: the echo chunk's, which follows it
            first = self.choices[0]
            echoed = 0 if self.chat or first.echo_pending else len(first.echo)
            out += TokenEvent(prompt_token_ids=self.prompts[0], header=self.header,
                              text_chars=echoed).sse()
        for c in self.choices:
            echo = "" if c.echo_pending else c.echo  # pending: with the prompt's logprobs
            if self.chat:
                out += self._chunk([ChatChunkChoice.model_validate({
                    "index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None})]).dump_sse()
            elif echo or self.internal.return_token_ids:
                out += self._chunk([TextChoice(index=c.index, text=echo, logprobs=None,
                                               finish_reason=None)]).dump_sse()
        return out

    def step(self, job: Job, batch: list[EngineOutput]) -> bytes:
        """Fold one update in; the events it makes (possibly none): its token event
        (with `return_token_ids`), then its content event when it has text, a finish
        reason or logprobs to show."""
        c = self.add(job, batch)
        finished = c.finish_reason is not None
        chars = len(c.new_text) + (len(c.echo) if c.echo_pending else 0)
        plain = self._plain(c, finished)
        choices: list[ChatChunkChoice] | list[TextChoice] = (
            [] if plain else self._chat_deltas(c, finished) if self.chat
            else self._text_delta(c, finished))
        out = b""
        if self.internal.return_token_ids and (c.new_token_ids or plain or choices):
            out += TokenEvent(token_ids=c.new_token_ids, text_chars=chars,
                              finished=finished).sse()
        if plain:
            return out + self.frames.event(c.index, c.new_text)
        for i in range(len(choices)):  # one event each; the last has the finish reason
            event = self._chunk(choices[i:i + 1])
            last = finished and i == len(choices) - 1
            out += (self._timed(event) if last else event).dump_sse()
        return out

    def _plain(self, c: Choice, finished: bool) -> bool:
        """Whether this update's event is a plain text delta only (`TextFrames`)."""
        return bool(c.new_text) and not (
            finished or self.want_logprobs or self.continuous_usage or c.echo_pending
            or c.tools is not None or c.thinking is not None)

    def _chat_deltas(self, c: Choice, finished: bool) -> list[ChatChunkChoice]:
        """A chat choice's stream choices for its latest update: its content, or its
        calls' parts, one delta each; logprobs and the finish reason on the last."""
        deltas = chat_deltas(c.new_text, finished, c.tools, c.thinking)
        reason, empty = c.finish_reason, {"content": ""}
        if c.tools is not None:
            reason, empty = c.tools.finish_reason(c.finish_reason), {}
        if not (deltas or finished or (self.want_logprobs and c.new_logprobs)):
            return []
        choices: list[dict] = [{"index": c.index, "delta": d, "logprobs": None,
                                "finish_reason": None}
                               for d in deltas or [empty]]
        choices[-1] |= {"logprobs": self._logprobs(c.new_logprobs, c.new_text_offset),
                        "finish_reason": reason}
        return [ChatChunkChoice.model_validate(choice) for choice in choices]

    def _text_delta(self, c: Choice, finished: bool) -> list[TextChoice]:
        """A completion choice's stream choice for its latest update (none when it has
        nothing to show); the first one of an echo with logprobs carries the prompt."""
        text = c.new_text
        lps = self._logprobs(c.new_logprobs, c.new_text_offset)
        if c.echo_pending:
            c.echo_pending = False
            text = c.echo + text
            lps = self._text_logprobs(c, c.new_logprobs, c.new_text_offset, True)
        elif not (text or finished or (self.want_logprobs and c.new_logprobs)):
            return []
        return [TextChoice.model_validate({"index": c.index, "text": text, "logprobs": lps,
                                           "finish_reason": c.finish_reason})]

    def usage_event(self) -> bytes:
        return ResponseChunk.of(self.header, [], self.usage()).dump_sse()

    # -- parts -----------------------------------------------------------------------------
    def usage(self) -> Usage:
        """Usage of the whole stream: a resumed one counts from the original prompt and
        includes the tokens the interrupted pod sent."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        resume = self.internal.resume
        if resume is not None:
            prompt, completion = resume.prompt_tokens, completion + resume.completion_tokens
        cached = max(c.cached for c in self.choices)
        return Usage.of(prompt, completion, cached)

    def _logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return self.texts.chat_logprobs(lps)
        return self.texts.completion_logprobs(lps, offset)

    def _text_logprobs(self, c: Choice, lps: list[TokenLogprobs], offset: int,
                       with_prompt: bool) -> dict | None:
        """A completion's logprobs, after its prompt's when it has them (echo)."""
        out = self._logprobs(lps, offset)
        if out is None or not with_prompt or c.prompt_logprobs is None:
            return out
        prompt = self.prompts[c.index * len(self.prompts) // len(self.choices)]
        return joined(self.texts.prompt_logprobs(prompt, c.prompt_logprobs), out)

    def _whole_message(self, c: Choice) -> ChatChoice:
        message = {"role": "assistant", **chat_message(c.text, c.tools, c.thinking)}
        reason = c.finish_reason
        if c.tools is not None:
            reason = c.tools.finish_reason(reason)
        return ChatChoice.model_validate({
            "index": c.index, "message": message,
            "logprobs": self._logprobs(c.logprobs, c.text_offset), "finish_reason": reason})

    def _chunk(self, choices: list[ChatChunkChoice] | list[TextChoice]) -> ResponseChunk:
        # vLLM's continuous_usage_stats: the usage so far on every chunk
        return ResponseChunk.of(self.header, choices,
                                self.usage() if self.continuous_usage else None)

    def _timed(self, event: _Timed) -> _Timed:
        if self.internal.timing is not None and self.first_token is not None:
            event.baton_ttft = ttft_breakdown(self.internal.timing, self.first_token,
                                              self.kv_transfer_s)
        return event


async def body(answer: Answer, updates: AsyncIterator[Update]) -> dict:
    """The whole response body, once `updates` ends."""
    async for job, batch in updates:
        answer.add(job, batch)
    return answer.body()


async def events(answer: Answer, updates: AsyncIterator[Update]) -> AsyncIterator[bytes]:
    """The SSE stream: the opening, the updates' events, the usage event when asked for,
    an error as an event (the status line is gone by then), and `[DONE]`."""
    try:
        opening = answer.opening()
        if opening:
            yield opening
        async for job, batch in updates:
            chunk = answer.step(job, batch)
            if chunk:
                yield chunk
        if answer.request.include_usage:
            yield answer.usage_event()
    except Exception as err:  # noqa: BLE001 - reported in-band
        yield sse(engine_error(err).body())
    yield SSE_DONE


def ttft_breakdown(router: dict[str, float], first: FirstToken,
                   transfer: float | None) -> TTFTBreakdown:
    queue = first.queue_s or 0.0
    parts = {"router_queue_s": router.get("router_queue", 0.0),
             "prefill_s": router.get("prefill", 0.0), "decode_queue_s": queue,
             "first_token_s": max(first.worker_s - queue, 0.0)}
    parts["total_s"] = sum(parts.values())
    parts["transfer_s"] = transfer or 0.0
    return TTFTBreakdown(**{k: round(v, 6) for k, v in parts.items()})


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
