"""The worker service: FastAPI over the AsyncEngine (`baton serve`).

The HTTP server starts at once; the model loads on a thread meanwhile, so `/health` answers
during the load and `/ready` turns 200 when the engine can take requests. A load failure
stops the server (and `baton serve` exits non-zero).

Endpoints: the OpenAI surface (`/v1/models`, `/v1/completions`, `/v1/chat/completions`,
served by `pipeline.py`; `/v1/responses`, as chat, by `responses.py`; vLLM's `/tokenize` and `/detokenize`, and its `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, by `lora.py`), `/health` (liveness: the process and its engine loop are alive),
`/ready` (model loaded, engine loop alive), `/metrics` (Prometheus), `/load` (JSON load
report for routers), `/internal/tokenizer` (for routers that tokenise), and the prefill and
decode roles' internal endpoints (`internal.py`).

`WorkerSettings` and `WorkerState` live in `state.py` and are importable from here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, PlainTextResponse, Response

from baton.common.auth import TENANT_HEADER, TOKEN_HEADER, bearer, token_matches
from baton.common.errors import OpenAIError, install_error_handlers
from baton.common.internal import WORKER_HEADER, worker_header
from baton.common.lora_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from baton.common.metrics import CONTENT_TYPE, render
from baton.common.parsing import parse_off_loop, parse_request_off_loop
from baton.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from baton.common.roles import Role
from baton.common.tokenize_protocol import (
    DetokenizeRequest,
    parse_tokenize_request,
)
from baton.worker.internal import install_internal_routes
from baton.worker.pipeline import Call
from baton.worker.responses import install_responses_routes
from baton.worker.state import WorkerSettings, WorkerState
from baton.worker.threads import on_a_thread_that_ends

__all__ = ["WorkerSettings", "WorkerState", "build_app"]

log = logging.getLogger("baton.worker")
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # what API keys guard


def build_app(settings: WorkerSettings, state: WorkerState | None = None) -> FastAPI:
    """The worker's app; its lifespan loads the engine (unless `state` has one already),
    runs the registration and the tuning watcher, and stops them all on shutdown."""
    state = state or WorkerState(settings)
    app = FastAPI(title="baton worker", lifespan=_lifespan(state), docs_url=None,
                  redoc_url=None)
    app.state.worker = state
    install_error_handlers(app)
    _install_auth(app, settings)
    _install_service_routes(app, state)
    _install_openai_routes(app, state)
    install_responses_routes(app, state)
    if settings.role != Role.BOTH:
        install_internal_routes(app, state)
    app.add_middleware(_Identify, value=worker_header(state.worker_id))  # the outermost
    return app


class _Identify:
    """ASGI middleware: every answer names the worker (`WORKER_HEADER`), refusals of the
    auth middleware included, so a router believes only Baton workers."""

    def __init__(self, app, value: str) -> None:
        self.app, self.header = app, (WORKER_HEADER.lower().encode(), value.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, named)


def _install_auth(app: FastAPI, settings: WorkerSettings) -> None:
    """With the internal token set, /internal/* needs it (`X-Baton-Token`); with API keys
    set, /v1/*, /tokenize and /detokenize need one of them as a bearer token, or the
    internal token (a router's call). Probes, metrics and /load stay open. Plain ASGI:
    streams pass untouched."""
    if settings.internal_token is not None or settings.api_keys:
        app.add_middleware(_Auth, token=settings.internal_token, keys=settings.api_keys)


class _Auth:
    def __init__(self, app, token: str | None, keys: tuple[str, ...]) -> None:
        self.app, self.token, self.keys = app, token, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            internal = self.token is not None and token_matches(headers.get(TOKEN_HEADER),
                                                                self.token)
            err = self._refuse(scope["path"], headers, internal)
            if err is not None:
                return await JSONResponse(err.body(), err.status, err.headers)(
                    scope, receive, send)
            if not internal and TENANT_HEADER in headers:  # only a router names a tenant
                tenant = TENANT_HEADER.lower().encode()
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"]
                                              if k.lower() != tenant]}
        await self.app(scope, receive, send)

    def _refuse(self, path: str, headers: Headers, internal: bool) -> OpenAIError | None:
        if path.startswith("/internal/") and self.token is not None and not internal:
            return OpenAIError(401, f"internal endpoints need the deployment's internal "
                                    f"token ({TOKEN_HEADER})", code="invalid_internal_token")
        if path.startswith(KEYED_PATHS) and self.keys and not internal:
            given = bearer(headers.get("authorization"))
            if not any(token_matches(given, k) for k in self.keys):
                return OpenAIError(401, "invalid or missing API key (send Authorization: "
                                        "Bearer <key>)", code="invalid_api_key")
        return None


def _lifespan(state: WorkerState):
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = None
        if state.registration is not None:
            state.registration.start()
        if state.engine is None:
            task = asyncio.create_task(_load(state))
        yield
        if state.registration is not None:
            await state.registration.stop()
        if state.watcher is not None:
            await state.watcher.stop()
        if task is not None:
            task.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
    return lifespan


def _install_service_routes(app: FastAPI, state: WorkerState) -> None:
    """Routes for operators and routers: liveness, readiness, metrics, load, tokenizer."""
    settings = state.settings

    @app.get("/health")
    async def health():
        if state.load_error is not None or (state.engine is not None
                                            and state.engine.dead_error is not None):
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading" if state.engine is None else "dead"},
                                status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None:  # KV pulls the engine timed since the last scrape
            await state.engine.sync_stats()
            for seconds in state.engine.take_kv_transfer_durations():
                state.metrics.kv_transfer_seconds.observe(seconds)
        return Response(render(state.metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/load")
    async def load() -> dict:
        if state.engine is not None:
            await state.engine.sync_stats()
        return state.load_report().model_dump(mode="json")

    @app.get("/internal/tokenizer")
    async def tokenizer():
        """What a router needs to turn prompts into this engine's token ids (and so into
        its KV block hashes) without loading the model: the tokenizer's JSON, the chat
        template and the special tokens the template may name."""
        pipeline = state.require_pipeline()
        tok = pipeline.tokenizer
        if tok is None:  # --skip-tokenizer-init: the router hashes prompts approximately
            raise OpenAIError(404, "this worker runs without a tokenizer "
                                   "(--skip-tokenizer-init)", code="no_tokenizer")
        return {"model": settings.model_name, "block_size": settings.engine.cache.block_size,
                "max_model_len": pipeline.serving.max_model_len,
                "tokenizer_json": tok.backend_tokenizer.to_str(),
                "chat_template": tok.chat_template,
                "special_tokens": {k: v for k, v in tok.special_tokens_map.items()
                                   if isinstance(v, str)}}


def _install_openai_routes(app: FastAPI, state: WorkerState) -> None:
    @app.get("/v1/models")
    async def models():
        pipeline = state.require_pipeline()
        created, max_len = int(state.started), pipeline.serving.max_model_len
        return {"object": "list", "data": [{  # every served name, the primary first (vLLM's)
            "id": name, "object": "model", "created": created,
            "owned_by": "baton", "max_model_len": max_len}
            for name in pipeline.model_names] + pipeline.lora.model_cards(created, max_len)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        req = parse_request(LoadLoRAAdapterRequest, await request.body())
        return PlainTextResponse(await state.require_pipeline().lora.load(req))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        req = parse_request(UnloadLoRAAdapterRequest, await request.body())
        return PlainTextResponse(await state.require_pipeline().lora.unload(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse_request_off_loop(ChatCompletionRequest, await request.body())
        return await state.require_pipeline().serve(request, Call("chat", req))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse_request_off_loop(CompletionRequest, await request.body())
        return await state.require_pipeline().serve(request, Call("completions", req))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse_off_loop(parse_tokenize_request, await request.body())
        return await asyncio.to_thread(state.require_pipeline().tokenize, req)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_request(DetokenizeRequest, await request.body())
        return state.require_pipeline().detokenize(req)


async def _load(state: WorkerState) -> None:
    """Load the engine off the event loop; then attach the registry to its block events
    and start the tuning watcher. A failure stops the server."""
    t0 = time.perf_counter()
    try:
        await on_a_thread_that_ends(state.load)
    except Exception as err:  # noqa: BLE001 - reported, then the server stops
        state.load_error = err
        log.exception("loading the engine failed; stopping the worker")
        os.kill(os.getpid(), signal.SIGTERM)
        return
    log.info("engine ready in %.1fs (model %s)", time.perf_counter() - t0,
             state.settings.model_name)
    if state.registration is not None:
        assert state.engine is not None  # state.load() returned: it set the engine
        state.registration.attach(state.engine.block_events())
    if state.watcher is not None:  # it read the file at start, into settings.engine
        from baton.worker.tuning import WorkerTuner

        settings = state.settings
        tuner = WorkerTuner(state.engine, settings.engine, settings.pinned, state.metrics)
        state.watcher.start(tuner.apply, state.metrics.reloaded)
