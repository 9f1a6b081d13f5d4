"""Relaying one OpenAI request to a worker, with retries and deadlines.

An attempt fails over to another worker (never the same one twice) when nothing has reached
the client yet: connection refused or reset, a timeout before the response headers, a 5xx,
a 429 (that worker's queue is full), or a stream that ends before its first byte. Once the
first bytes are relayed the stream is committed: a decode pod that fails after that has its
stream resumed on another decode pod (`resume.py`); otherwise it ends with an in-band error
event and `[DONE]`. A 4xx other than 429 is the client's error and is relayed as is.

Deadlines: `connect_timeout_s` to open a connection, `first_byte_timeout_s` for the response
headers and first chunk, `idle_timeout_s` between chunks, and `request_timeout_s` for the
whole request (one timer per request, rescheduled per chunk: no task per read). The stream
is relayed chunk by chunk as it arrives, never buffered. If the client goes away, the
handler is cancelled and the upstream connection is closed, which aborts the request on
the worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from baton.common.errors import OpenAIError
from baton.common.metrics import RouterMetrics
from baton.router.discovery import Discovery, Endpoint
from baton.router.prefix import TOKENS_PER_BLOCK, PrefixIndex, block_hashes, prompt_of
from baton.router.resume import DecodeCall, StreamTracker
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.pipeline import PREFILL_FILTERS, RoutingPipeline
from baton.router.tokens import TokenizerCache

log = logging.getLogger("baton.router")
INLINE_TOKENIZE_BYTES = 4096  # bodies up to ~1,000 tokens are tokenized on the event loop


@dataclass(frozen=True)
class ProxySettings:
    max_attempts: int = 3
    backoff_s: float = 0.05  # doubled after each failed attempt
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"ProxySettings.max_attempts={self.max_attempts} must be >= 1")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
                     "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProxySettings.{name} must be > 0")


@dataclass(frozen=True)
class DisaggSettings:
    """Remote prefill when the prompt tokens not already cached on the chosen decode pod
    are at least `min_prefill_tokens` and a prefill worker is healthy and not saturated;
    `n` > 1 and several prompts stay local. With the registry the router counts the
    prompt's tokens and the pod's cached blocks exactly; without it, it estimates (~4
    characters a token; the cache as `router.prefix` knows it)."""

    min_prefill_tokens: int = 256
    prefill_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0 or self.prefill_timeout_s <= 0:
            raise ValueError("DisaggSettings: min_prefill_tokens >= 0, prefill_timeout_s > 0")


def estimate_prompt_tokens(api: str, req) -> int | None:
    """A rough token count for the decision (~4 characters a token, plus the chat
    template's few tokens a message), or None when the request cannot be split."""
    prompt = prompt_of(api, req)
    if req.n != 1 or prompt is None:
        return None
    if not isinstance(prompt, str):
        return len(prompt)
    return len(prompt) // 4 + (8 * len(req.messages) if api == "chat" else 0)


class _Interrupted(Exception):
    """A decode pod's stream broke after bytes reached the client; it can be resumed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Retryable(Exception):
    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response  # what to answer if no other worker is left


class Proxy:
    def __init__(self, session: aiohttp.ClientSession, discovery: Discovery,
                 pipeline: RoutingPipeline, metrics: RouterMetrics,
                 settings: ProxySettings, disagg: DisaggSettings | None = None) -> None:
        self.session = session
        self.discovery = discovery
        self.pipeline = pipeline
        self.metrics = metrics
        self.settings = settings
        self.disagg = disagg or DisaggSettings()
        self.prefill_pipeline = RoutingPipeline(filters=PREFILL_FILTERS, picker="max_score",
                                                scorers={"queue": 1.0, "prefix": 1.0})
        self._timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s)
        self.prefix = PrefixIndex()
        self.tokenizers = TokenizerCache(session)

    async def context(self, api: str, req, model: str, body_bytes: int = 0) -> RoutingContext:
        """The routing context of a request, with its prompt's block hashes: the engine's
        own, when the registry tells what the workers hold and this model's tokenizer is
        here; else the router's estimate. Long prompts are tokenized on a thread (~3 ms
        for 2,000 tokens; the tokenizer releases the GIL), short ones inline."""
        index = self.discovery.block_index()
        if index is not None:
            tok = self.tokenizers.get(model, [e.url for e in self.discovery.all()
                                              if e.healthy and e.model == model])
            ids = None
            if tok is not None:
                ids = (await asyncio.to_thread(tok.prompt_ids, api, req)
                       if body_bytes > INLINE_TOKENIZE_BYTES else tok.prompt_ids(api, req))
            if ids is not None:
                return RoutingContext(model=model, prefix_index=index,
                                      prefix_hashes=tok.block_hashes(ids),
                                      block_tokens=tok.block_size,
                                      prompt_tokens=len(ids) if req.n == 1 else None)
        prompt = prompt_of(api, req)
        return RoutingContext(model=model, prefix_index=self.prefix,
                              prefix_hashes=block_hashes(prompt) if prompt else [],
                              block_tokens=TOKENS_PER_BLOCK)

    async def remote_prefill(self, api: str, req, body: bytes, request_id: str,
                             ctx: RoutingContext) -> DecodeCall | None:
        """Pick the decode pod, then decide, and when remote, run the prefill: returns what
        the decode pod gets, with the prompt's ids and `kv_transfer_params` when a prefill
        pod ran, without them to prefill on the decode pod (the fallback); None without
        decode pods (colocated)."""
        endpoints = self.discovery.all()
        if not any(e.role == "decode" for e in endpoints):
            return None
        call = DecodeCall(api, json.loads(body))
        call.preferred = self.pipeline.pick(endpoints, ctx)
        cached = 0
        if call.preferred is not None:
            cached = ctx.prefix_index.match(call.preferred.url,
                                            ctx.prefix_hashes) * ctx.block_tokens
        found = await self._prefill(api, req, call, request_id, ctx, cached, endpoints)
        if found is not None:
            call.prompt_token_ids, call.kv_transfer_params = found
        return call

    async def _prefill(self, api: str, req, call: DecodeCall, request_id: str,
                       ctx: RoutingContext, cached: int, endpoints: list[Endpoint]
                       ) -> tuple[list[int], dict] | None:
        if not any(e.role == "prefill" for e in endpoints):
            return None  # no prefill pods: nothing to decide
        tokens = ctx.prompt_tokens
        if tokens is None:
            tokens = estimate_prompt_tokens(api, req)
        if tokens is None or tokens - cached < self.disagg.min_prefill_tokens:
            self.metrics.disagg_decisions.labels("local").inc()
            return None
        ep = self.prefill_pipeline.pick(endpoints, RoutingContext(
            model=ctx.model, role="prefill", prefix_hashes=ctx.prefix_hashes,
            prefix_index=ctx.prefix_index, block_tokens=ctx.block_tokens))
        if ep is None:
            self.metrics.disagg_decisions.labels("local").inc()
            self.metrics.fallbacks.labels("no_prefill_worker").inc()
            return None
        payload = json.dumps({"api": api, "request": call.request}).encode()
        t0 = time.monotonic()
        ep.inflight += 1
        try:
            async with asyncio.timeout(self.disagg.prefill_timeout_s):
                async with self.session.post(
                        ep.url + "/internal/prefill", data=payload, timeout=self._timeout,
                        headers={"Content-Type": "application/json",
                                 "X-Request-Id": request_id + "-prefill"}) as resp:
                    answer = await resp.json() if resp.status == 200 else None
                    status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
            self.discovery.record_failure(ep)
            self.metrics.fallbacks.labels("prefill_failed").inc()
            self.metrics.disagg_decisions.labels("local").inc()
            log.warning("request %s: prefill on %s failed (%r); prefilling on decode",
                        request_id, ep.url, err)
            return None
        finally:
            ep.inflight -= 1
            call.prefill_s = time.monotonic() - t0
        if answer is None:
            if status >= 500:
                self.discovery.record_failure(ep)
            self.metrics.fallbacks.labels("prefill_error").inc()
            self.metrics.disagg_decisions.labels("local").inc()
            return None
        self.discovery.record_success(ep)
        ctx.prefix_index.add(ep.url, ctx.prefix_hashes)
        self.metrics.disagg_decisions.labels("remote").inc()
        return answer["prompt_token_ids"], answer["kv_transfer_params"]

    async def forward(self, request: web.Request, path: str, body: bytes, request_id: str,
                      ctx: RoutingContext, stream: bool, decode: DecodeCall | None = None,
                      received: float | None = None) -> web.StreamResponse:
        """Colocated workers get the client's request on `path`; decode pods get `decode`
        on /internal/generate (the first try on the pod it was planned for), and a stream
        they drop moves to another decode pod. `received` (monotonic) is when the request
        arrived, for a TTFT breakdown when the client asked for one (`X-Baton-Timing`)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.request_timeout_s
        model = ctx.model
        client = _ClientSide(request)
        tracker = StreamTracker(decode) if decode is not None and decode.resumable else None
        last: _Retryable | None = None
        attempt = 0
        preferred = decode.preferred if decode is not None else None
        while attempt < s.max_attempts:
            if preferred is not None and preferred.healthy and not preferred.circuit_open():
                ep = preferred
            else:
                ep = self.pipeline.pick(self.discovery.all(), ctx)
            preferred = None
            if ep is None:
                break
            ctx.prefix_index.add(ep.url, ctx.prefix_hashes)
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(min(s.backoff_s * 2 ** (attempt - 1),
                                        max(deadline - loop.time(), 0)))
            attempt += 1
            ep.inflight += 1
            internal = decode is not None and ep.role == "decode"
            if internal and tracker is not None and tracker.resumes:
                payload = tracker.continuation()
            else:
                payload = decode.body() if internal else body
            headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
            if received is not None and "X-Baton-Timing" in request.headers:
                prefill = decode.prefill_s if decode is not None else 0.0
                queued = max(time.monotonic() - received - prefill, 0.0)
                headers["X-Baton-Timing"] = f"router_queue={queued:.6f},prefill={prefill:.6f}"
            try:
                return await self._attempt(client, ep, "/internal/generate" if internal
                                           else path, payload, headers, stream, deadline,
                                           tracker if internal else None)
            except _Retryable as err:
                last = err
                ctx.tried.add(ep.url)
                ctx.prefix_index.forget(ep.url)
                self.metrics.upstream_errors.labels(ep.url, err.reason).inc()
                log.warning("request %s: worker %s failed (%s); %s", request_id, ep.url,
                            err.reason, "retrying" if attempt < s.max_attempts
                            else "giving up")
            except _Interrupted as err:
                ctx.tried.add(ep.url)
                ctx.prefix_index.forget(ep.url)
                ctx.role = "resume"  # only decode pods can take the stream over
                self.metrics.upstream_errors.labels(ep.url, "mid-stream").inc()
                if tracker.exhausted:
                    await client.out.write(tracker.closing_events())
                    await client.out.write_eof()
                    return client.out
                tracker.resumes += 1
                attempt = 0  # a fresh set of attempts for the continuation
                self.metrics.fallbacks.labels("decode_lost").inc()
                log.warning("request %s: decode pod %s failed mid-stream (%s) after %d "
                            "tokens; resuming on another decode pod", request_id, ep.url,
                            err.reason, len(tracker.sent))
                last = _Retryable(err.reason)
            finally:
                ep.inflight -= 1
        if last is not None and last.response is not None and client.out is None:
            return last.response
        if last is not None:
            error = OpenAIError(502, f"no worker could serve the request (last error: "
                                     f"{last.reason})", code="upstream_failed")
        else:
            error = OpenAIError(503, f"no healthy worker serves model {model!r}",
                                code="no_worker", headers={"Retry-After": "1"})
        if client.out is None:
            raise error
        return await client.fail_in_band(error)  # 200 and headers already went out

    async def _attempt(self, client: _ClientSide, ep: Endpoint, path: str, body: bytes,
                       headers: dict, stream: bool, deadline: float,
                       tracker: StreamTracker | None = None) -> web.StreamResponse:
        """One try on one worker; raises _Retryable while no body byte reached the client.
        For a stream, the client gets its 200 and headers as soon as the worker sends its
        own (so the first token is not held up by header processing); the body is still
        untouched, so a failure before the first byte can move to another worker."""
        s = self.settings
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        timer = asyncio.timeout_at(min(t0 + s.first_byte_timeout_s, deadline))
        resp = None
        try:
            async with timer:
                resp = await self.session.post(ep.url + path, data=body, headers=headers,
                                               timeout=self._timeout)
                self.metrics.upstream_latency.labels(ep.url).observe(loop.time() - t0)
                if resp.status >= 500 or resp.status == 429:
                    content = await resp.read()
                    if resp.status >= 500:
                        self.discovery.record_failure(ep)
                    raise _Retryable(f"status {resp.status}", web.Response(
                        body=content, status=resp.status, content_type=resp.content_type,
                        headers=_passthrough(resp.headers)))
                if not stream or resp.status != 200:
                    timer.reschedule(deadline)
                    content = await resp.read()
                    self.discovery.record_success(ep)
                    return web.Response(body=content, status=resp.status,
                                        content_type=resp.content_type)
                await client.start()
                first = await resp.content.readany()
                if not first:
                    raise _Retryable("stream ended before its first byte")
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            self.discovery.record_failure(ep)
            phase = "before response headers" if resp is None else "before the first byte"
            raise _Retryable(f"{type(err).__name__} {phase}") from None
        finally:
            if resp is not None and (not stream or resp.status != 200):
                resp.release()
        self.discovery.record_success(ep)
        try:
            await self._relay(client, ep, resp, first, deadline, tracker)
        except BaseException:
            resp.close()  # drops the connection: the worker sees it and aborts the request
            raise
        resp.release()  # read to the end: the connection goes back to the pool
        return client.out

    async def _relay(self, client: _ClientSide, ep: Endpoint, resp: aiohttp.ClientResponse,
                     first: bytes, deadline: float, tracker: StreamTracker | None) -> None:
        out = client.out
        write = out.write if tracker is None else _tracked(out, tracker)
        loop = asyncio.get_running_loop()
        idle = self.settings.idle_timeout_s
        try:
            await write(first)
            async with asyncio.timeout_at(min(loop.time() + idle, deadline)) as timer:
                read = resp.content.readany
                while chunk := await read():
                    await write(chunk)
                    timer.reschedule(min(loop.time() + idle, deadline))
            if tracker is not None and not tracker.finished:
                raise aiohttp.ClientPayloadError("the stream ended without [DONE]")
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError, TimeoutError) as err:
            if client.gone:
                raise  # the client is gone too; nothing to tell
            if tracker is not None and tracker.can_resume and loop.time() < deadline:
                raise _Interrupted(type(err).__name__) from None
            self.metrics.upstream_errors.labels(ep.url, "mid-stream").inc()
            log.warning("worker %s failed mid-stream: %r", ep.url, err)
            await client.fail_in_band(OpenAIError(
                502, f"the worker failed mid-stream: {type(err).__name__}",
                code="upstream_failed"))
            return
        try:
            await out.write_eof()
        except ConnectionResetError:
            pass  # the client left after the last event ([DONE]); nothing is lost


def _tracked(out: web.StreamResponse, tracker: StreamTracker):
    async def write(chunk: bytes) -> None:
        public = tracker.feed(chunk)
        if public:
            await out.write(public)
    return write


class _ClientSide:
    """The client's half of one streamed exchange."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.out: web.StreamResponse | None = None

    @property
    def gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def start(self) -> None:
        if self.out is None:
            self.out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            await self.out.prepare(self.request)

    async def fail_in_band(self, error: OpenAIError) -> web.StreamResponse:
        """After the 200 went out, an error can only be an event in the stream."""
        await self.out.write(b"data: " + json.dumps(error.body()).encode() + b"\n\n"
                             + b"data: [DONE]\n\n")
        await self.out.write_eof()
        return self.out


def _passthrough(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "retry-after"}
