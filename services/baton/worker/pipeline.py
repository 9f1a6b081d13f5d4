"""Serving one OpenAI request, from its parsed body to the HTTP response.

    Pipeline.serve: check the model -> tokenise (unless the prompt's ids are given) ->
    `Serving.make_jobs` -> `Serving.admit` (or 429) -> the response: an SSE stream
    (`openai_api.events`) or one JSON body (`openai_api.body`) over `Serving.run`.

Whatever way the answer ends (done, error, the client leaving), every job still running is
aborted so its KV blocks are freed. A whole (non-streamed) answer watches for the client's
disconnect and stops early; a stream stops when the server can no longer write to it.
The public routes (`app.py`) and the decode role's /internal/generate (`internal.py`) both
end here; so do vLLM's /tokenize and /detokenize (`tokenize`, `detokenize`).
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass, replace

from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from baton.common.auth import TENANT_HEADER
from baton.common.errors import OpenAIError
from baton.common.internal import Api, OpenAIBody
from baton.common.prompt_bound import max_prompt_chars
from baton.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from baton.common.sampling_params import SamplingParams
from baton.common.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from baton.common.tracing import Span, Tracing
from baton.engine.kv_connector import PullKV, PullPrefix
from baton.engine.tokenizer import encode_rendered, render_conversation, require_tokenizer
from baton.worker import openai_api, traces
from baton.worker.coalesce import coalesced
from baton.worker.fair_share import DEFAULT_TENANT
from baton.worker.lora import WorkerLoRA
from baton.worker.openai_api import PUBLIC, Internal, OpenAIFormat
from baton.worker.serving import Job, Serving, engine_error, new_id


@dataclass(frozen=True)
class Call:
    """One OpenAI request to serve: `prompts` are the prompt's token ids when a router
    gave them (else the body is tokenised here), `kv` the KV a prefill pod holds for it,
    `internal` what a router asked of the answer."""

    api: Api
    request: OpenAIBody
    prompts: list[list[int]] | None = None
    kv: PullKV | PullPrefix | None = None
    internal: Internal = PUBLIC


class Pipeline:
    """`priority_scheduling`: the engine runs lower `priority` values first (else a
    request's non-zero `priority` is a 400)."""

    def __init__(self, serving: Serving, fmt: OpenAIFormat, tracing: Tracing | None = None,
                 priority_scheduling: bool = False, model_names: tuple[str, ...] = (),
                 lora: WorkerLoRA | None = None, stream_interval: int = 1) -> None:
        """`model_names`: every name requests may use for the base model
        (`--served-model-name`); responses report `fmt.model_name`, the primary. `lora`:
        the LoRA adapters requests may name instead (none when None)."""
        self.serving = serving
        self.format = fmt
        self.stream_interval = stream_interval  # `worker.coalesce`
        self.tracing = tracing or Tracing()
        self.model_name = fmt.model_name
        self.model_names = model_names or (fmt.model_name,)
        self.lora = lora or WorkerLoRA(None, self.model_names)
        self.tokenizer = fmt.tokenizer
        self.priority_scheduling = priority_scheduling
        # a prompt longer than this cannot fit: refused before it is tokenised (None: no
        # sound bound for this tokenizer, or none)
        self.max_prompt_chars = (
            max_prompt_chars(self.tokenizer.backend_tokenizer.to_str(), serving.max_model_len)
            if hasattr(self.tokenizer, "backend_tokenizer") else None)

    def check_model(self, name: str) -> None:
        """A 404 OpenAIError unless `name` is one of the names this worker serves (the base
        model's or a LoRA adapter's)."""
        if not self.lora.served(name):
            raise self.lora.not_found(name)

    def require_tokenizer(self, what: str, param: str = "prompt"):
        """The tokenizer, or a 400 OpenAIError when the worker runs without one."""
        try:
            return require_tokenizer(self.tokenizer, what)
        except ValueError as err:
            raise OpenAIError(400, str(err), param=param) from None

    def prompts(self, api: Api, request: OpenAIBody) -> list[list[int]]:
        """The request's prompts as token ids: chat's one (through the chat template, a 400
        when it rejects the messages) or completions' one or more."""
        if api == "chat":
            return [self._chat_prompt(request)]
        assert isinstance(request, CompletionRequest)  # the body of api "completions"
        return [self._encode(p) if isinstance(p, str) else list(p) for p in request.prompts()]

    def _encode(self, prompt: str) -> list[int]:
        tokenizer = self.require_tokenizer("a text prompt")
        self.check_prompt_chars(len(prompt), "prompt")
        return tokenizer.encode(prompt)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A 400 (context_length_exceeded) for a prompt text too long to fit in any
        tokenisation (`common.prompt_bound`), before it is tokenised."""
        bound = self.max_prompt_chars
        if bound is not None and chars > bound:
            raise OpenAIError(400, f"this model's maximum context length is "
                                   f"{self.serving.max_model_len} tokens, and a prompt of "
                                   f"{chars} characters has more with this tokenizer (at "
                                   f"most {bound} characters fit)", param=param,
                              code="context_length_exceeded")

    async def tokenize_prompts(self, api: Api, request: OpenAIBody) -> list[list[int]]:
        """`prompts` on a thread: a long prompt's tokenisation does not hold the event loop
        (the fast tokenizer drops the GIL while it encodes)."""
        return await asyncio.to_thread(self.prompts, api, request)

    def _chat_prompt(self, request) -> list[int]:
        """A conversation's (chat or /tokenize) ids through the chat template, its tools
        included."""
        tokenizer = self.require_tokenizer("chat (the model's chat template)", "messages")
        try:
            text = render_conversation(tokenizer, request.template_messages(),
                                        request.add_generation_prompt,
                                       tools=request.template_tools(),
                                       **(request.chat_template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - template errors are the caller's input
            raise OpenAIError(400, f"the chat template rejected the messages: {err}",
                              param="messages") from None
        self.check_prompt_chars(len(text), "messages")
        return encode_rendered(tokenizer, text)

    async def serve(self, http: Request, call: Call) -> Response:
        """Answer `call`, streamed or whole. Raises OpenAIError (4xx before anything was
        queued, 429 when the waiting queue is full, 5xx when the engine fails before a
        whole answer is ready); a stream reports later errors in-band."""
        req, internal = call.request, call.internal
        lora = await self.lora.adapter_for(req.model)  # None: the base model
        timing = http.headers.get("x-baton-timing")
        if timing is not None:
            internal = replace(internal, timing=parse_timing(timing))
        params = self.sampling_params(call.api, req)
        prompts = (call.prompts if call.prompts is not None
                   else await self.tokenize_prompts(call.api, req))
        grammar = await self.serving.compile_grammar(params.structured, constraint_field(req))
        prefix = "chatcmpl" if call.api == "chat" else "cmpl"
        rid = response_id(prefix, http.headers.get("x-request-id"))
        resume = internal.resume
        jobs = self.serving.make_jobs(  # engine ids are ours, whatever the client sent
            new_id(prefix), prompts, params,
            "messages" if call.api == "chat" else "prompt", kv=call.kv,
            presampled=resume.completion_tokens if resume is not None else 0,
            priority=req.priority, grammar=grammar,  # an fcfs worker takes 0 only (sampling_params checks)
            lora=lora)
        if internal.return_token_ids and len(jobs) != 1:
            raise OpenAIError(400, "return_token_ids needs one prompt and n = 1",
                              param="return_token_ids")
        answer = self.format.answer(call.api, req, rid, prompts, len(jobs), internal)
        span = traces.start_request(self.tracing, f"worker.{call.api}", http.headers,
                                    **{"baton.stream": req.stream, "baton.jobs": len(jobs)})
        return await self._respond(http, jobs, answer, req.stream, span)

    def sampling_params(self, api: Api, req: OpenAIBody) -> SamplingParams:
        """The request's sampling parameters on this worker. Raises a 400 OpenAIError for
        a `priority` this worker does not schedule by, or tool calls it cannot read."""
        if req.priority and not self.priority_scheduling:
            raise OpenAIError(400, f"priority {req.priority} needs a worker started with "
                                   "--scheduling-policy priority; this one schedules first "
                                   "come, first served", param="priority")
        params = req.to_sampling_params()
        if api == "chat":
            assert isinstance(req, ChatCompletionRequest)  # the body of api "chat"
            self.format.tools.check(req)
            if self.format.tools.keeps_special_tokens(req):
                params = replace(params, skip_special_tokens=False)
            params = self.format.reasoning.sampling_params(req, params)
        return params

    def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt's or a conversation's token ids (a 400 for a text
        longer than any prompt that fits; call it off the event loop)."""
        if req.model is not None:
            self.check_model(req.model)
        self.require_tokenizer("/tokenize")
        if isinstance(req, TokenizeChatRequest):
            ids = self._chat_prompt(req)
        else:
            self.check_prompt_chars(len(req.prompt), "prompt")
            ids = list(self.tokenizer.encode(req.prompt,
                                             add_special_tokens=req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.serving.max_model_len,
                "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: token ids' text. A 400 for ids outside the vocabulary."""
        if req.model is not None:
            self.check_model(req.model)
        vocab = len(self.require_tokenizer("/detokenize", "tokens"))
        outside = [t for t in req.tokens if t >= vocab]
        if outside:
            raise OpenAIError(400, f"token ids {outside[:8]} are outside the vocabulary "
                                   f"({vocab} tokens)", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def _respond(self, http: Request, jobs: list[Job], answer: openai_api.Answer,
                       stream: bool, span: Span) -> Response:
        """Admit the jobs (or raise), then answer; every job still running when the answer
        ends is aborted (a stream's in a background task after its last byte), and the
        request's span ends."""
        serving = self.serving
        try:
            serving.admit(jobs, tenant_of(http))
        except OpenAIError as err:
            traces.end_request(self.tracing, span, jobs, err)
            raise
        if stream:
            async def done() -> None:  # on the loop: a sync one would cost a thread hop
                serving.abort(jobs)
                traces.end_request(self.tracing, span, jobs)
            updates = coalesced(serving.run(jobs), self.stream_interval)
            return StreamingResponse(openai_api.events(answer, updates),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(done),
                                     headers={"Cache-Control": "no-cache"})
        error: BaseException | None = None
        try:
            body = await until_disconnect(http, openai_api.body(answer, serving.run(jobs)))
        except OpenAIError as err:
            error = err
            raise
        except Exception as err:  # noqa: BLE001 - engine death or a bug: a clean 5xx
            error = err
            raise engine_error(err) from None
        finally:
            serving.abort(jobs)
            traces.end_request(self.tracing, span, jobs, error)
        return JSONResponse(body)


_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TIMING_PARTS = ("router_queue", "prefill")  # what a router's X-Baton-Timing names
MAX_TIMING_S = 86400.0


def constraint_field(req: OpenAIBody) -> str:
    """The request field its output constraint comes from, for a 400 about it."""
    return next(iter(req.constraints()), "response_format")


def response_id(prefix: str, client_id: str | None) -> str:
    """The response's `id`: the client's `X-Request-Id` when it is a plain token (a router
    resuming a stream sends the same one, so the id stays), else a new one. It names the
    response only: engine requests, leases and logs' keys never take a client's id."""
    if client_id is not None and _CLIENT_ID.fullmatch(client_id):
        return client_id
    return new_id(prefix)


def parse_timing(header: str) -> dict[str, float]:
    """`X-Baton-Timing`: "1" / "true" from a client (no router part), or the router's
    "name=seconds,..." (`router_queue`, `prefill`: finite, in [0, MAX_TIMING_S]). A 400
    OpenAIError otherwise."""
    if header.strip().lower() in ("1", "true", "yes", ""):
        return {}
    try:
        parts = {k.strip(): float(v) for k, v in (p.split("=", 1) for p in header.split(","))}
    except ValueError:
        parts = {"": math.nan}
    if len(parts) > len(TIMING_PARTS) or not all(
            k in TIMING_PARTS and 0 <= v <= MAX_TIMING_S for k, v in parts.items()):
        raise OpenAIError(400, f"X-Baton-Timing is 1/true, or name=seconds pairs separated by "
                               f"commas (names {', '.join(TIMING_PARTS)}; seconds in "
                               f"[0, {MAX_TIMING_S:g}])")
    return parts


def tenant_of(http: Request) -> str:
    """The router's name for the caller's tenant (`X-Baton-Tenant`; the auth middleware
    drops it from any caller that is not a router), else `default`."""
    name = http.headers.get(TENANT_HEADER, "")
    return name if 0 < len(name) <= 64 else DEFAULT_TENANT


async def until_disconnect(http: Request, coro):
    """Await `coro`, cancelling it if the client disconnects first (a 499 OpenAIError)."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise OpenAIError(499, "the client disconnected", code="client_disconnected")
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
