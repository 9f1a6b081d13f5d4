"""The router service (`baton router`): the OpenAI surface in front of the workers.

It validates each request against the same strict schema the workers use (a bad request is
answered here and never reaches a worker), checks the model, and passes the request along
its path: its routing context (`routing_context.py`), the decode pod and remote prefill of
a disaggregated deployment (`remote_prefill.py`, deciding with `scheduling/disagg.py`), and
the retry loop (`retry.py`) whose attempts relay the answer (`relay.py`) and resume a
decode stream that breaks (`resume.py`). `/v1/models` aggregates what the healthy workers
serve; `/tokenize` and `/detokenize` (vLLM's) go to a worker of the model, with retries. Settings and the live `Tunables` are in `settings.py`. Never imports torch.

Around that path: the caller's tenant (`tenants.py`: API keys, rate limits), the latency
the client sees (`slo.py`), a `router.request` span continuing the client's `traceparent`
(`common.tracing`), and the release of a prefilled lease no decode pod took over
(`handover.py`). Every call to a worker carries the internal token (`X-Baton-Token`, from
`common.auth`), never the client's `Authorization`. The server closes connections whose
request head does not arrive within `--header-timeout` (`common.http_limits`).

Built on aiohttp's server rather than FastAPI: the router is a relay on the hot path of every
token, and aiohttp's server and client on one event loop cost a fraction of an ASGI stack
per chunk (see the router benchmark in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import cast

import aiohttp
import uvloop
from aiohttp import web

from baton.common.auth import upstream_headers
from baton.common.errors import OpenAIError
from baton.common.http_limits import aiohttp_protocols
from baton.common.internal import Api, OpenAIBody
from baton.common.metrics import CONTENT_TYPE, RouterMetrics, render
from baton.common.parsing import parse_off_loop, parse_request_off_loop
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.common.responses_api import ResponsesRequest
from baton.common.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    parse_tokenize_request,
)
from baton.common.tracing import Span, Tracing, setup_tracing
from baton.common.tuning import ConfigWatcher, Tuning, TuningError
from baton.router.discovery import Discovery, StaticDiscovery
from baton.router.handover import Releaser
from baton.router.middleware import TENANT, authenticate, error_response, openai_errors
from baton.router.prefix import BlockIndex
from baton.router.redis_discovery import RegistryDiscovery
from baton.router.relay import Relay
from baton.router.remote_prefill import RemotePrefill
from baton.router.responses import CHAT_PATH, ResponsesRoute, make_store
from baton.router.retry import Forwarder, Inbound
from baton.router.routing_context import ContextBuilder
from baton.router.scheduling.context import RoutingContext
from baton.router.settings import RouterSettings, Tunables
from baton.router.slo import ClientClock
from baton.router.tenants import RateLimited, Tenant, Tenants, TokenCharge
from baton.router.tokens import TokenizerCache

log = logging.getLogger("baton.router")
MAX_BODY_BYTES = 64 << 20
ClientBody = ChatCompletionRequest | CompletionRequest | ResponsesRequest


class Router:
    """The service: discovery, metrics, the live `Tunables`, and (from `lifespan`, which
    opens the HTTP session) the request path: context builder, remote prefill, retry loop."""

    def __init__(self, settings: RouterSettings, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.tenants = Tenants(settings.all_tenants, time.monotonic())
        self.tracing = tracing or setup_tracing("baton-router", settings.otlp_endpoint)
        self.discovery: Discovery
        self.exact_index: BlockIndex | None = None  # what the workers hold (registry only)
        if settings.registry_url:
            self.discovery = RegistryDiscovery(settings.registry_url, settings.registry_prefix,
                                               settings.breaker)
            self.exact_index = self.discovery.blocks
        else:
            self.discovery = StaticDiscovery(list(settings.workers), settings.check_interval_s,
                                             breaker=settings.breaker)
        self.tunables = Tunables.of(settings)  # swapped whole on a reload, never patched
        self.tokenizers: TokenizerCache | None = None
        self.contexts: ContextBuilder | None = None
        self.prefill: RemotePrefill | None = None
        self.forwarder: Forwarder | None = None
        self.releaser: Releaser | None = None
        self._gauged: set[str] = set()  # upstreams with a health gauge series
        self.watcher = None
        if settings.config_dir is not None:
            self.watcher = ConfigWatcher(settings.config_dir)
        self.responses_api = ResponsesRoute(make_store(settings))

    def apply_tuning(self, new: Tuning, _old: Tuning | None = None) -> list[str]:
        """Routing weights, the disaggregation threshold, retries and deadlines from the
        tuning file's `router` section (a field it leaves out, or a flag pins, keeps the
        flag's value): a new `Tunables` for the requests that arrive from now on. Called on
        the event loop. Raises TuningError, changing nothing, if the result is invalid."""
        try:
            tunables = Tunables.of(self.settings, new.router)
        except ValueError as err:
            raise TuningError(f"router: {err}") from None
        self.tunables = tunables
        return []

    async def lifespan(self, _app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        session = aiohttp.ClientSession(  # every call to a worker carries the token
            connector=connector, auto_decompress=False,
            headers=upstream_headers(self.settings.internal_token))
        self.tokenizers = TokenizerCache(session)
        self.contexts = ContextBuilder(self.discovery, self.exact_index, self.tokenizers)
        self.prefill = RemotePrefill(session, self.discovery, self.metrics, self.tracing)
        self.releaser = Releaser(session, self.metrics, self.tracing)
        self.forwarder = Forwarder(self.discovery, self.metrics,
                                   Relay(session, self.discovery, self.metrics, self.tracing))
        if self.watcher is not None:
            self.apply_tuning(self.watcher.load_initial())  # an invalid file: no start
            self.watcher.start(self.apply_tuning, self.metrics.reloaded)
        await self.discovery.start(session)
        await self.discovery.wait_first_round(timeout=2.0)
        yield
        if self.watcher is not None:
            await self.watcher.stop()
        await self.tokenizers.close()
        await self.releaser.close()
        await self.responses_api.close()
        await self.discovery.stop()
        await session.close()

    # -- handlers --------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        if not any(e.healthy for e in self.discovery.all()):
            return web.json_response({"status": "no healthy worker"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        urls = set()
        for ep in self.discovery.all():
            self.metrics.upstream_healthy.labels(ep.url).set(1 if ep.healthy else 0)
            urls.add(ep.url)
        for gone in self._gauged - urls:  # a pod that left: no series stuck at its last value
            self.metrics.upstream_healthy.remove(gone)
        self._gauged = urls
        if isinstance(self.discovery, RegistryDiscovery):
            self.metrics.registry_connected.set(1 if self.discovery.connected else 0)
        return web.Response(body=render(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE})

    async def workers(self, _request: web.Request) -> web.Response:
        """The router's view: each worker's load, and with the registry the KV blocks it
        holds and the models whose prompts the router hashes exactly."""
        index = self.exact_index
        return web.json_response({
            "source": "registry" if index is not None else "static",
            "exact_prefix_models": self.tokenizers.models() if self.tokenizers else [],
            "workers": [{
                "url": e.url, "healthy": e.healthy, "role": e.role, "model": e.model,
                "models": list(e.names), "lora_adapters": list(e.lora_adapters),
                "lora_loaded": list(e.lora_loaded), "running": e.running, "waiting": e.waiting, "inflight": e.inflight,
                "kv_usage": round(e.kv_usage, 4), "circuit_open": e.circuit_open(),
                **({"worker_id": e.worker_id, "cached_blocks": index.blocks_held(e)}
                   if index is not None else {})}
                for e in self.discovery.all()]})

    async def models(self, _request: web.Request) -> web.Response:
        seen: dict[str, dict[str, object]] = {}
        for e in self.discovery.all():
            for name in e.names if e.healthy else ():  # every served name (aliases too)
                seen.setdefault(name, {"id": name, "object": "model",
                                       "created": int(time.time()), "owned_by": "baton",
                                       "max_model_len": e.max_model_len})
            for name in e.lora_adapters if e.healthy else ():  # LoRA adapters (vLLM's card)
                seen.setdefault(name, {"id": name, "object": "model",
                                       "created": int(time.time()), "owned_by": "baton",
                                       "parent": e.model, "max_model_len": e.max_model_len})
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/chat/completions", ChatCompletionRequest, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/completions", CompletionRequest, "completions")

    async def responses(self, request: web.Request) -> web.StreamResponse:  # as chat
        return await self._relay(request, "/v1/responses", ResponsesRequest, "chat")

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._tokenizer_call(request, parse_tokenize_request)

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._tokenizer_call(
            request, lambda body: parse_request(DetokenizeRequest, body))

    async def _tokenizer_call(self, request: web.Request,
                              parse: Callable[[bytes], TokenizeRequest | DetokenizeRequest]
                              ) -> web.StreamResponse:
        """/tokenize or /detokenize: validated here, answered by a worker of the body's
        model (any worker without one), retried like any request."""
        tenant = request[TENANT]
        try:
            tenant.admit(time.monotonic())
            body = await request.read()
            req = await parse_off_loop(parse, body)
            if req.model is not None:
                self._check_model(req.model)
            rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            inbound = Inbound(request, request.path, body, rid, stream=False)
            assert self.forwarder is not None  # lifespan made it before serving
            response = await self.forwarder.forward(inbound, RoutingContext(model=req.model),
                                                    None, self.tunables)
        except OpenAIError as err:
            response = error_response(err)
        self.metrics.requests.labels(str(response.status), tenant.name).inc()
        return response

    async def _relay(self, request: web.Request, path: str, model_cls: type[ClientBody],
                     api: Api) -> web.StreamResponse:
        received = time.monotonic()
        tenant = request[TENANT]
        with self.tracing.span("router.request", headers=request.headers, attributes={
                "url.path": path, "baton.tenant": tenant.name}) as span:
            try:
                response = await self._answer(request, path, model_cls, api, tenant,
                                              received, span)
            except OpenAIError as err:
                if isinstance(err, RateLimited):
                    self.metrics.rate_limited.labels(tenant.name, err.limit).inc()
                response = error_response(err)
            span.set("http.response.status_code", response.status)
        self.metrics.requests.labels(str(response.status), tenant.name).inc()
        return response

    async def _answer(self, request: web.Request, path: str, model_cls: type[ClientBody],
                      api: Api, tenant: Tenant, received: float, span: Span
                      ) -> web.StreamResponse:
        """Admit, parse, route and relay one request; raises OpenAIError for an answer the
        router gives itself. A Responses request goes as the chat request of its turn."""
        tunables = self.tunables  # this request's snapshot, whatever a reload does meanwhile
        tenant.admit(received)
        body = await request.read()
        turn = await self.responses_api.start(body) if model_cls is ResponsesRequest else None
        req = turn.chat if turn else await parse_request_off_loop(
            cast(type[OpenAIBody], model_cls), body)
        body, path = (turn.chat_body, CHAT_PATH) if turn else (body, path)
        self._check_model(req.model)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        span.set("baton.request_id", rid)
        span.set("baton.model", req.model)
        # lifespan made these before serving
        assert (self.contexts is not None and self.prefill is not None
                and self.forwarder is not None and self.releaser is not None)
        ctx = replace(await self.contexts.build(
            api, req, len(body), request.headers.get("X-Session-Id") or req.user),
            tenant=tenant.name)
        charge = TokenCharge.of(api, req, ctx.prompt_tokens, len(body),
                                self._context_window(req.model))
        tenant.charge(charge.total, time.monotonic())
        response: web.StreamResponse | None = None
        clock: ClientClock | None = None
        try:
            decode = await self.prefill.plan(api, req, rid, ctx, tunables)
            decision = decode.decision if decode is not None else "local"
            span.set("baton.decision", decision)
            clock = ClientClock(self.metrics, received, req.stream, req.model, decision,
                                tenant.name)
            inbound = Inbound(request, path, body, rid, req.stream, received, clock,
                              turn.format if turn is not None else None)
            try:
                response = await self.forwarder.forward(inbound, ctx, decode, tunables)
            finally:  # a client gone, or no decode pod took it: the prefill pod frees the KV
                self.releaser.release_unclaimed(
                    decode.handover if decode is not None else None, rid)
            answer: bytes | None = None  # a metered non-streamed answer's body, for its usage
            if tenant.tokens is not None and isinstance(response, web.Response):
                # cast: the router builds its answers from bytes (relay's resp.read(), JSON)
                answer = cast(bytes, response.body)
            clock.finish(response.status, answer)
        finally:  # what it used; a request refused or failed before an answer used nothing
            used = (charge.used(clock.usage_tokens, clock.chunks)
                    if response is not None and clock is not None and response.status == 200
                    else 0)
            tenant.settle(charge.total, used, time.monotonic())
        if turn is not None:
            response = await self.responses_api.finish(turn, response)
        return response

    def _context_window(self, model: str) -> int | None:
        """The largest context window of the workers serving `model` (None: none says)."""
        return max((e.max_model_len for e in self.discovery.all()
                    if e.max_model_len is not None and e.serves(model)), default=None)

    def _check_model(self, model: str) -> None:
        known = {name for e in self.discovery.all() for name in (*e.names, *e.lora_adapters)}
        if known and model not in known:
            raise OpenAIError(404, f"the model {model!r} does not exist; served: "
                                   f"{sorted(known)}", param="model", code="model_not_found")


ROUTER = web.AppKey("router", Router)  # the app's Router, for tests and tools


def build_app(settings: RouterSettings, tracing: Tracing | None = None) -> web.Application:
    router = Router(settings, tracing)
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[openai_errors, authenticate(router.tenants)])
    app[ROUTER] = router
    app.cleanup_ctx.append(router.lifespan)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_page)
    app.router.add_get("/workers", router.workers)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/responses", router.responses)
    router.responses_api.add_routes(app.router)  # GET and DELETE /v1/responses/{id}
    app.router.add_post("/tokenize", router.tokenize)
    app.router.add_post("/detokenize", router.detokenize)
    return app


async def listen(settings: RouterSettings, host: str, port: int,
                 tracing: Tracing | None = None) -> tuple[web.AppRunner, asyncio.Server]:
    """The router serving on host:port (its connections under the head deadline); stop
    it with `server.close()` then `runner.cleanup()`."""
    runner = web.AppRunner(build_app(settings, tracing), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    assert runner.server is not None  # setup() creates it
    metrics = runner.app[ROUTER].metrics
    protocols = aiohttp_protocols(runner.server, settings.header_timeout_s,
                                  metrics.header_timeouts.inc)
    server = await asyncio.get_running_loop().create_server(protocols, host, port,
                                                            reuse_address=True)
    return runner, server


def run(settings: RouterSettings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; a client that disconnects cancels its handler."""

    async def serve() -> None:
        runner, server = await listen(settings, host, port)
        log.info("router listening on http://%s:%d, workers: %s", host, port,
                 settings.registry_url or ", ".join(settings.workers))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            server.close()
            await runner.cleanup()
            runner.app[ROUTER].tracing.shutdown()

    uvloop.run(serve())
