"""The router service (`baton router`): the OpenAI surface in front of the workers.

It validates each request against the same strict schema the workers use (a bad request is
answered here and never reaches a worker), checks the model, picks a worker through the
routing pipeline and relays the answer (`proxy.py`). `/v1/models` aggregates what the
healthy workers serve. Never imports torch.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from baton.common.errors import OpenAIError, install_error_handlers
from baton.common.metrics import CONTENT_TYPE, RouterMetrics, render
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.router.discovery import BreakerSettings, StaticDiscovery
from baton.router.proxy import Proxy, ProxySettings
from baton.router.scheduling.pipeline import RoutingPipeline

log = logging.getLogger("baton.router")


@dataclass(frozen=True)
class RouterSettings:
    workers: tuple[str, ...]
    policy: str = "load"
    scorer_weights: dict[str, float] | None = None
    check_interval_s: float = 1.0
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("RouterSettings.workers: give at least one worker URL")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"RouterSettings.workers: {url!r} is not an http(s) URL")
        RoutingPipeline.from_policy(self.policy, self.scorer_weights)  # validates names


def build_app(settings: RouterSettings) -> FastAPI:
    metrics = RouterMetrics()
    discovery = StaticDiscovery(list(settings.workers), settings.check_interval_s,
                                breaker=settings.breaker)
    pipeline = RoutingPipeline.from_policy(settings.policy, settings.scorer_weights)
    holder: dict[str, Proxy] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        holder["proxy"] = Proxy(session, discovery, pipeline, metrics, settings.proxy)
        await discovery.start(session)
        await discovery.wait_first_round(timeout=2.0)
        yield
        await discovery.stop()
        await session.close()

    app = FastAPI(title="baton router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.discovery = discovery
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not any(e.healthy for e in discovery.all()):
            return JSONResponse({"status": "no healthy worker"}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics_page():
        for ep in discovery.all():
            metrics.upstream_healthy.labels(ep.url).set(1 if ep.healthy else 0)
        return Response(render(metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/workers")
    async def workers():
        return {"workers": [{"url": e.url, "healthy": e.healthy, "role": e.role,
                             "model": e.model, "running": e.running, "waiting": e.waiting,
                             "inflight": e.inflight, "kv_usage": round(e.kv_usage, 4),
                             "circuit_open": e.circuit_open()} for e in discovery.all()]}

    @app.get("/v1/models")
    async def models():
        seen: dict[str, dict] = {}
        for e in discovery.all():
            if e.healthy and e.model and e.model not in seen:
                seen[e.model] = {"id": e.model, "object": "model", "created": int(time.time()),
                                 "owned_by": "baton", "max_model_len": e.max_model_len}
        return {"object": "list", "data": list(seen.values())}

    async def relay(request: Request, path: str, model_cls) -> Response:
        try:
            response = await _relay(request, path, model_cls)
        except OpenAIError as err:
            metrics.requests.labels(str(err.status)).inc()
            raise
        metrics.requests.labels(str(response.status_code)).inc()
        return response

    async def _relay(request: Request, path: str, model_cls) -> Response:
        body = await request.body()
        req = parse_request(model_cls, body)
        known = {e.model for e in discovery.all() if e.model}
        if known and req.model not in known:
            raise OpenAIError(404, f"the model {req.model!r} does not exist; served: "
                                   f"{sorted(known)}", param="model", code="model_not_found")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        return await holder["proxy"].forward(path, body, rid, req.model, req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relay(request, "/v1/chat/completions", ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions", CompletionRequest)

    return app
