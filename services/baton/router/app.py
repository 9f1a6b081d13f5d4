"""The router service (`baton router`): the OpenAI surface in front of the workers.

It validates each request against the same strict schema the workers use (a bad request is
answered here and never reaches a worker), checks the model, picks a worker through the
routing pipeline and relays the answer (`proxy.py`). `/v1/models` aggregates what the
healthy workers serve. Never imports torch.

Built on aiohttp's server rather than FastAPI: the router is a relay on the hot path of every
token, and aiohttp's server and client on one event loop cost a fraction of an ASGI stack
per chunk (see the router benchmark in the README).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
import uuid
from dataclasses import dataclass, field, replace

import aiohttp
import uvloop
from aiohttp import web

from baton.common.errors import OpenAIError
from baton.common.metrics import CONTENT_TYPE, RouterMetrics, render
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.common.tuning import ConfigWatcher, Tuning, TuningError, set_fields
from baton.router.discovery import BreakerSettings, Discovery, StaticDiscovery
from baton.router.registry import RegistryDiscovery
from baton.router.proxy import DisaggSettings, Proxy, ProxySettings
from baton.router.scheduling.pipeline import RoutingPipeline

log = logging.getLogger("baton.router")
MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True)
class RouterSettings:
    workers: tuple[str, ...] = ()  # static worker URLs (local mode), or
    registry_url: str | None = None  # redis://… where workers register (clusters)
    registry_prefix: str = "baton"
    api_key: str | None = None  # clients must send `Authorization: Bearer <key>`
    policy: str = "load"
    scorer_weights: dict[str, float] | None = None
    check_interval_s: float = 1.0
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    disagg: DisaggSettings = field(default_factory=DisaggSettings)
    config_dir: str | None = None  # a mounted tuning ConfigMap (common.tuning), live
    pinned: frozenset[str] = frozenset()  # tuning fields set by flags: the file keeps off

    def __post_init__(self) -> None:
        if not self.workers and not self.registry_url:
            raise ValueError("RouterSettings: give worker URLs (workers) or a Redis "
                             "registry (registry_url)")
        if self.workers and self.registry_url:
            raise ValueError("RouterSettings: workers and registry_url exclude each other")
        if self.registry_url and not self.registry_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"RouterSettings.registry_url: {self.registry_url!r} is not a "
                             "redis:// URL")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"RouterSettings.workers: {url!r} is not an http(s) URL")
        RoutingPipeline.from_policy(self.policy, self.scorer_weights)  # validates names


def _error(err: OpenAIError) -> web.Response:
    return web.Response(body=err.json_bytes(), status=err.status, headers=err.headers,
                        content_type="application/json")


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        self.discovery: Discovery
        if settings.registry_url:
            self.discovery = RegistryDiscovery(settings.registry_url, settings.registry_prefix,
                                               settings.breaker)
        else:
            self.discovery = StaticDiscovery(list(settings.workers), settings.check_interval_s,
                                             breaker=settings.breaker)
        self.pipeline = RoutingPipeline.from_policy(settings.policy, settings.scorer_weights)
        self.proxy: Proxy | None = None
        self._gauged: set[str] = set()  # upstreams with a health gauge series
        self.watcher = None
        if settings.config_dir is not None:
            self.watcher = ConfigWatcher(settings.config_dir)

    def apply_tuning(self, new: Tuning, _old: Tuning | None = None) -> list[str]:
        """Routing weights, the disaggregation threshold, retries and deadlines from the
        tuning file's `router` section (a field it leaves out, or a flag pins, keeps the
        flag's value). Raises TuningError, changing nothing, if the result is invalid."""
        s = self.settings
        t = {k: v for k, v in set_fields(new.router).items() if k not in s.pinned}
        try:
            pipeline = RoutingPipeline.from_policy(s.policy,
                                                   t.get("scorer_weights", s.scorer_weights))
            proxy = replace(s.proxy, **{k: t[k] for k in (
                "max_attempts", "first_byte_timeout_s", "idle_timeout_s",
                "request_timeout_s") if k in t})
            disagg = replace(s.disagg, **{f: t[k] for k, f in (
                ("disagg_min_prefill_tokens", "min_prefill_tokens"),
                ("prefill_timeout_s", "prefill_timeout_s")) if k in t})
        except ValueError as err:
            raise TuningError(f"router: {err}") from None
        self.pipeline = pipeline
        if self.proxy is not None:
            self.proxy.pipeline, self.proxy.settings, self.proxy.disagg = pipeline, proxy, disagg
        return []

    async def lifespan(self, _app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.proxy = Proxy(session, self.discovery, self.pipeline, self.metrics,
                           self.settings.proxy, self.settings.disagg)
        if self.watcher is not None:
            self.apply_tuning(self.watcher.load_initial())  # an invalid file: no start
            self.watcher.start(self.apply_tuning, self.metrics.reloaded)
        await self.discovery.start(session)
        await self.discovery.wait_first_round(timeout=2.0)
        yield
        if self.watcher is not None:
            await self.watcher.stop()
        await self.proxy.tokenizers.close()
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
        index = self.discovery.block_index()
        return web.json_response({
            "source": "registry" if index is not None else "static",
            "exact_prefix_models": self.proxy.tokenizers.models() if self.proxy else [],
            "workers": [{
                "url": e.url, "healthy": e.healthy, "role": e.role, "model": e.model,
                "running": e.running, "waiting": e.waiting, "inflight": e.inflight,
                "kv_usage": round(e.kv_usage, 4), "circuit_open": e.circuit_open(),
                **({"worker_id": e.worker_id,
                    "cached_blocks": len(index.held.get(e.worker_id, ()))}
                   if index is not None else {})}
                for e in self.discovery.all()]})

    async def models(self, _request: web.Request) -> web.Response:
        seen: dict[str, dict] = {}
        for e in self.discovery.all():
            if e.healthy and e.model and e.model not in seen:
                seen[e.model] = {"id": e.model, "object": "model", "created": int(time.time()),
                                 "owned_by": "baton", "max_model_len": e.max_model_len}
        return web.json_response({"object": "list", "data": list(seen.values())})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/chat/completions", ChatCompletionRequest, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, "/v1/completions", CompletionRequest, "completions")

    async def _relay(self, request: web.Request, path: str, model_cls,
                     api: str) -> web.StreamResponse:
        received = time.monotonic()
        try:
            body = await request.read()
            req = parse_request(model_cls, body)
            known = {e.model for e in self.discovery.all() if e.model}
            if known and req.model not in known:
                raise OpenAIError(404, f"the model {req.model!r} does not exist; served: "
                                       f"{sorted(known)}", param="model",
                                  code="model_not_found")
            rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            ctx = await self.proxy.context(api, req, req.model, len(body))
            ctx.session = request.headers.get("X-Session-Id") or req.user
            decode = await self.proxy.remote_prefill(api, req, body, rid, ctx)
            response = await self.proxy.forward(request, path, body, rid, ctx, req.stream,
                                                decode, received)
        except OpenAIError as err:
            response = _error(err)
        self.metrics.requests.labels(str(response.status)).inc()
        return response


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """Unknown paths, wrong methods and oversized bodies answer in the OpenAI error shape."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return _error(OpenAIError(413, "the request body is too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(OpenAIError(exc.status, exc.reason))


def _api_key(key: str):
    """With an API key, the OpenAI paths (/v1/…) need `Authorization: Bearer <key>`, as
    vLLM's --api-key; health, readiness and metrics stay open for probes and scrapers."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1/") and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(), expected):
            return _error(OpenAIError(401, "invalid or missing API key (send "
                                           "Authorization: Bearer <key>)",
                                      code="invalid_api_key"))
        return await handler(request)
    return check


def build_app(settings: RouterSettings) -> web.Application:
    router = Router(settings)
    middlewares = [_openai_errors] + ([_api_key(settings.api_key)] if settings.api_key else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app["router"] = router
    app.cleanup_ctx.append(router.lifespan)
    app.router.add_get("/health", router.health)
    app.router.add_get("/ready", router.ready)
    app.router.add_get("/metrics", router.metrics_page)
    app.router.add_get("/workers", router.workers)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/v1/chat/completions", router.chat_completions)
    app.router.add_post("/v1/completions", router.completions)
    return app


def run(settings: RouterSettings, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; a client that disconnects cancels its handler."""

    async def serve() -> None:
        runner = web.AppRunner(build_app(settings), handler_cancellation=True,
                               access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        log.info("router listening on http://%s:%d, workers: %s", host, port,
                 settings.registry_url or ", ".join(settings.workers))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    uvloop.run(serve())
