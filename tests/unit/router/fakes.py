"""In-process fake workers and a real router in front of them (aiohttp test servers)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from baton.common.internal import (
    WORKER_HEADER,
    KVEndpointInfo,
    KVLayoutInfo,
    KVTransferParams,
    PrefillResponse,
    StreamHeader,
    TokenEvent,
    worker_header,
)
from baton.common.tracing import Tracing
from baton.router.app import ROUTER, build_app
from baton.router.settings import RouterSettings

Reply = Callable[["FakePod", web.Request, bytes], Awaitable[web.StreamResponse]]
HEADER = StreamHeader(id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m")


IDENTITY = web.AppKey("identity", str)


async def identify(request: web.Request, response: web.StreamResponse) -> None:
    """What every Baton worker puts on its answers (`identity`; a worker of a static list
    has no registry id to match); an app without an identity names none."""
    identity = request.app.get(IDENTITY, worker_header("fake-pod"))
    if identity:
        response.headers[WORKER_HEADER] = identity


class FakePod:
    """A worker of `role` that reports itself ready on /load (`ready`) and answers every
    POST with `reply`, recording the bodies and headers it got; `/internal/release` records
    the lease ids it is asked to release, and every GET's headers are kept too."""

    def __init__(self, role: str, reply: Reply, identity: str | None = None) -> None:
        """`identity`: the X-Baton-Worker it answers with ("": none; None: a worker's)."""
        self.role, self.reply = role, reply
        self.ready = True
        self.bodies: list[bytes] = []
        self.headers: list[CIMultiDict[str]] = []
        self.get_headers: dict[str, CIMultiDict[str]] = {}  # path -> the last GET's headers
        self.released: list[str] = []
        self.release_headers: list[CIMultiDict[str]] = []
        app = web.Application()
        app.on_response_prepare.append(identify)
        if identity is not None:
            app[IDENTITY] = identity
        app.router.add_get("/load", self._load)
        app.router.add_get("/internal/tokenizer", self._tokenizer)
        app.router.add_post("/internal/release", self._release)
        app.router.add_post("/{path:.*}", self._post)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    async def _load(self, request: web.Request) -> web.Response:
        self.get_headers[request.path] = request.headers.copy()
        return web.json_response({"ready": self.ready, "role": self.role, "model": "m",
                                  "running": 0, "waiting": 0, "kv_blocks_used": 0,
                                  "kv_blocks_total": 10})

    async def _tokenizer(self, request: web.Request) -> web.Response:
        self.get_headers[request.path] = request.headers.copy()
        return web.json_response({"error": "no tokenizer here"}, status=404)

    async def _release(self, request: web.Request) -> web.Response:
        self.release_headers.append(request.headers.copy())
        self.released.append((await request.json())["lease_id"])
        return web.json_response({"released": True})

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        return await self.reply(self, request, body)


async def start(*pods: FakePod, tracing: Tracing | None = None,
                **settings) -> tuple[TestServer, list[FakePod]]:
    """The pods, and a router in front of them that has seen them all healthy."""
    for pod in pods:
        await pod.server.start_server()
    router = TestServer(build_app(RouterSettings(workers=tuple(p.url for p in pods),
                                                 **settings), tracing))
    await router.start_server()
    return router, list(pods)


async def stop(router: TestServer, pods: list[FakePod]) -> None:
    await router.close()
    for pod in pods:
        await pod.server.close()


def metric(router: TestServer, name: str, **labels) -> float:
    value = router.app[ROUTER].metrics.registry.get_sample_value(name, labels)
    return value or 0.0


# -- answers -----------------------------------------------------------------------------
def content(text: str, finish: str | None = None, **delta) -> bytes:
    event = HEADER.model_dump() | {"choices": [{"index": 0, "delta": {"content": text, **delta},
                                               "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def tokens(ids=(), chars: int = 0, finished: bool = False, **first) -> bytes:
    return TokenEvent(token_ids=list(ids), text_chars=chars, finished=finished,
                      **first).sse()


async def stream(request: web.Request, *events: bytes, die: bool = False
                 ) -> web.StreamResponse:
    """An SSE answer of `events`; `die`: the connection drops after them (no end of body)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(event)
    if die:
        request.transport.close()
        return resp
    await resp.write_eof()
    return resp


def prefill_answer(prompt: list[int]) -> PrefillResponse:
    layout = KVLayoutInfo(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8,
                          dtype="bfloat16")
    return PrefillResponse(prompt_token_ids=prompt, prefill_s=0.01, kv_transfer_params=
                           KVTransferParams(endpoint=KVEndpointInfo(
                               transport="tcp", engine_id="e1", address="127.0.0.1:1",
                               layout=layout), block_ids=[3], num_tokens=len(prompt),
                               lease_id="lease-1", first_token=5, lease_ttl_s=30.0))


async def post(router: TestServer, body: dict, **headers) -> tuple[int, dict, str]:
    """The router's answer to a chat request: status, headers, the whole body."""
    async with aiohttp.ClientSession() as session:
        async with session.post(router.make_url("/v1/chat/completions"), json=body,
                                headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.text()


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra
