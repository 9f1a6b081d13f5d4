"""The worker service: FastAPI over the AsyncEngine (`baton serve`).

The HTTP server starts at once; the model loads on a thread meanwhile, so `/health` answers
during the load and `/ready` turns 200 when the engine can take requests. A load failure
stops the server (and `baton serve` exits non-zero).

Endpoints: the OpenAI surface (`/v1/models`, `/v1/completions`, `/v1/chat/completions`),
`/health` (liveness: the process and its engine loop are alive), `/ready` (model loaded,
engine loop alive), `/metrics` (Prometheus) and `/load` (JSON load report for routers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from baton.common.errors import OpenAIError, install_error_handlers
from baton.common.metrics import CONTENT_TYPE, WorkerMetrics, render
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.engine.config import EngineConfig
from baton.worker import openai_api
from baton.worker.serving import OpenAIServing, engine_error, new_id

log = logging.getLogger("baton.worker")
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class WorkerSettings:
    """`role` is `both` (colocated) until the disaggregation issue gives prefill/decode their
    internal endpoints. `max_waiting` bounds requests not yet scheduled; beyond it, 429."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    role: str = "both"
    served_model_name: str | None = None
    max_waiting: int = 256
    pinned: frozenset[str] = frozenset()  # tuning fields set by flags: the file keeps off
    registry_url: str | None = None  # redis://…: register there (common.registry)
    advertise_url: str | None = None  # how routers reach this worker (its pod IP)
    registry_prefix: str = "baton"

    def __post_init__(self) -> None:
        if self.registry_url is not None and not self.advertise_url:
            raise ValueError("WorkerSettings.advertise_url is needed with registry_url: the "
                             "URL routers reach this worker at (e.g. http://$POD_IP:8001)")
        if self.role not in ROLES:
            raise ValueError(f"WorkerSettings.role={self.role!r} must be one of {ROLES}")
        if self.max_waiting < 1:
            raise ValueError(f"WorkerSettings.max_waiting={self.max_waiting} must be >= 1")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.engine.model is None:
            return "SmolLM2-135M-Instruct"
        return os.path.basename(self.engine.model.rstrip("/")).removesuffix(".gguf")


class WorkerState:
    def __init__(self, settings: WorkerSettings, watcher=None) -> None:
        """`watcher`: a `common.tuning.ConfigWatcher` that read the tuning file at start."""
        self.settings = settings
        self.engine = None
        self.serving: OpenAIServing | None = None
        self.load_error: BaseException | None = None
        self.metrics = WorkerMetrics(self._snapshot)
        self.started = time.time()
        self.watcher = watcher
        self.registration = None
        if settings.registry_url is not None:
            from baton.worker.registration import Registration

            self.registration = Registration(settings.registry_url, settings.advertise_url,
                                             self.registry_report, settings.registry_prefix)

    def _snapshot(self) -> dict[str, float]:
        return self.engine.core.metrics_snapshot() if self.engine is not None else {}

    def load(self) -> None:
        from baton.engine.async_engine import AsyncEngine

        engine = AsyncEngine(self.settings.engine)
        engine.start()
        self.engine = engine
        self.serving = OpenAIServing(engine, self.settings.model_name, self.metrics,
                                     self.settings.max_waiting)

    def load_report(self) -> dict:
        """Role, model and load: what `/load` answers and the registry's heartbeat says."""
        snap, engine, serving = self._snapshot(), self.engine, self.serving
        return {"role": self.settings.role, "model": self.settings.model_name,
                "ready": self.ready, "running": int(snap.get("baton:num_requests_running", 0)),
                "waiting": engine.num_waiting if engine is not None else 0,
                "kv_blocks_used": int(snap.get("baton:kv_blocks_used", 0)),
                "kv_blocks_total": int(snap.get("baton:kv_blocks_total", 0)),
                "max_waiting": self.settings.max_waiting,
                "max_model_len": serving.max_model_len if serving else None}

    def registry_report(self) -> dict | None:
        if not self.ready:
            return None
        engine = self.settings.engine
        return {**self.load_report(), "block_size": engine.block_size,
                "kv_transport": engine.kv_transport}

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.is_alive

    def require_serving(self) -> OpenAIServing:
        if self.serving is None:
            raise OpenAIError(503, "the model is still loading", code="not_ready")
        return self.serving


def build_app(settings: WorkerSettings, state: WorkerState | None = None) -> FastAPI:
    state = state or WorkerState(settings)

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

    app = FastAPI(title="baton worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = state
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        if state.load_error is not None or (state.engine is not None
                                            and state.engine.dead_error is not None):
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not state.ready:
            return JSONResponse({"status": "loading" if state.engine is None else "dead"},
                                status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        kvx = state.engine.core.kvx if state.engine is not None else None
        if kvx is not None:  # durations the engine thread recorded since the last scrape
            seconds = kvx.stats.seconds
            while seconds:
                state.metrics.kv_transfer_seconds.observe(seconds.pop())
        return Response(render(state.metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/load")
    async def load():
        return state.load_report()

    @app.get("/internal/tokenizer")
    async def tokenizer():
        """What a router needs to turn prompts into this engine's token ids (and so into
        its KV block hashes) without loading the model: the tokenizer's JSON, the chat
        template and the special tokens the template may name."""
        tok = state.require_serving().tokenizer
        return {"model": settings.model_name, "block_size": settings.engine.block_size,
                "tokenizer_json": tok.backend_tokenizer.to_str(),
                "chat_template": tok.chat_template,
                "special_tokens": {k: v for k, v in tok.special_tokens_map.items()
                                   if isinstance(v, str)}}

    @app.get("/v1/models")
    async def models():
        serving = state.require_serving()
        return {"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": int(state.started),
            "owned_by": "baton", "max_model_len": serving.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_request(ChatCompletionRequest, await request.body())
        return await serve_openai(request, state, "chat", req)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await request.body())
        return await serve_openai(request, state, "completions", req)

    if settings.role != "both":
        from baton.worker.internal import install_internal_routes

        install_internal_routes(app, state)
    return app


def prompts_of(serving: OpenAIServing, api: str, req) -> list[list[int]]:
    return [serving.chat_prompt(req)] if api == "chat" else serving.completion_prompts(req)


async def serve_openai(request: Request, state: WorkerState, api: str, req,
                       prompts: list[list[int]] | None = None, kv: dict | None = None,
                       internal: openai_api.Internal = openai_api.PUBLIC):
    """Answer one OpenAI request: its prompts (tokenised here unless given), `n` samples,
    streamed or whole; `kv` carries the decode role's `kv_transfer_params`, `internal` what
    a router asked of /internal/generate."""
    serving = state.require_serving()
    serving.check_model(req.model)
    timing = request.headers.get("x-baton-timing")
    if timing is not None:
        internal = replace(internal, timing=_parse_timing(timing))
    params = req.to_sampling_params()
    prompts = prompts if prompts is not None else prompts_of(serving, api, req)
    rid = request.headers.get("x-request-id") or new_id(
        "chatcmpl" if api == "chat" else "cmpl")
    jobs = serving.make_jobs(rid, prompts, params, "messages" if api == "chat" else "prompt",
                             kv)
    if api == "chat":
        make_body = lambda: openai_api.chat(serving, req, jobs, rid, internal)  # noqa: E731
    else:
        make_body = lambda: openai_api.completion(  # noqa: E731
            serving, req, jobs, prompts, rid, internal)
    return await _respond(request, serving, jobs, make_body, req.stream)


def _parse_timing(header: str) -> dict:
    """`X-Baton-Timing`: "1" / "true" from a client, or the router's "name=seconds,..."."""
    if header.strip().lower() in ("1", "true", "yes", ""):
        return {}
    try:
        return {k.strip(): float(v) for k, v in (p.split("=", 1) for p in header.split(","))}
    except ValueError:
        raise OpenAIError(400, "X-Baton-Timing is 1/true, or name=seconds pairs separated by "
                               "commas") from None


async def _respond(request: Request, serving: OpenAIServing, jobs, make_body, stream: bool):
    """Queue the jobs and answer; whatever way the answer ends (done, error, the client
    leaving), every job still running is aborted so its blocks are freed."""
    serving.admit(jobs)
    abort = BackgroundTask(serving.abort, jobs)
    if stream:
        body = await make_body()
        return StreamingResponse(body, media_type="text/event-stream", background=abort,
                                 headers={"Cache-Control": "no-cache"})
    try:
        result = await _until_disconnect(request, make_body())
    except OpenAIError:
        raise
    except Exception as err:  # noqa: BLE001 - engine death or a bug: a clean 5xx
        raise engine_error(err) from None
    finally:
        serving.abort(jobs)
    return JSONResponse(result)


async def _until_disconnect(request: Request, coro):
    """Await `coro`, cancelling it if the client disconnects first."""
    work = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
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


async def _load(state: WorkerState) -> None:
    t0 = time.perf_counter()
    try:
        await asyncio.to_thread(state.load)
    except Exception as err:  # noqa: BLE001 - reported, then the server stops
        state.load_error = err
        log.exception("loading the engine failed; stopping the worker")
        os.kill(os.getpid(), signal.SIGTERM)
        return
    log.info("engine ready in %.1fs (model %s)", time.perf_counter() - t0,
             state.settings.model_name)
    if state.registration is not None:
        state.registration.attach(state.engine.core.kv.pool)
    if state.watcher is not None:  # it read the file at start, into settings.engine
        from baton.worker.tuning import WorkerTuner

        settings = state.settings
        tuner = WorkerTuner(state, settings.engine, settings.pinned, state.metrics)
        state.watcher.start(tuner.apply, state.metrics.reloaded)
