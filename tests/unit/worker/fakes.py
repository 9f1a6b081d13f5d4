"""A scripted engine behind the worker's real serving, formatting and HTTP layers, and a
bare ASGI client (no model, no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.common.internal import KVEndpointInfo, KVLayoutInfo, KVTransferParams
from baton.common.metrics import WorkerMetrics
from baton.common.sampling_params import SamplingParams
from baton.engine.errors import InvalidRequestError
from baton.engine.outputs import EngineOutput
from baton.engine.sampler import TokenLogprobs
from baton.worker.openai_api import OpenAIFormat
from baton.worker.pipeline import Pipeline
from baton.worker.serving import Serving

MODEL = "m"


class FakeTokenizer:
    """Token i is the text `<i>`; a string encodes to its character codes (after `bos`, if
    set, with special tokens). A template renders each message's content, and the tools'
    names."""

    chat_template = "fake"
    vocab_size = 1 << 17

    def __init__(self) -> None:
        self.bos: int | None = None
        self.rendered: list[dict] = []  # what each apply_chat_template call was given

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        special = [self.bos] if add_special_tokens and self.bos is not None else []
        return special + [ord(c) for c in text]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None,
                            tokenize=True, **_) -> list[int] | str:
        self.rendered.append({"messages": messages, "tools": tools})
        names = "".join(t["function"]["name"] for t in tools or ())
        text = chr(1) + "".join(m["content"] + names for m in messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv: object = None
    presampled: int = 0
    priority: int = 0
    finished: bool = False  # what the engine's status says (a test sets it)

    @property
    def is_finished(self) -> bool:
        return self.finished


def out(rid: str, tokens: list[int], text: str | None = None, finish: str | None = None,
        logprobs: bool = False, **extra) -> EngineOutput:
    """One engine output: `tokens`, their text (`<i>` each unless given), with logprob
    -0.5 for each token when `logprobs`."""
    text = "".join(f"<{t}>" for t in tokens) if text is None else text
    lps = [TokenLogprobs(t, -0.5, 1, []) for t in tokens] if logprobs else None
    return EngineOutput(rid, list(tokens), text, lps, finish_reason=finish, **extra)


def count_to(n: int) -> Callable[[FakeRequest], list[list[EngineOutput]]]:
    """A script: tokens 10, 11, ... one per batch, the n-th finishing with `length`."""
    def script(req: FakeRequest) -> list[list[EngineOutput]]:
        return [[out(req.request_id, [10 + i], finish="length" if i == n - 1 else None,
                     queue_time=0.01 if i in (0, n - 1) else None)] for i in range(n)]
    return script


@dataclass
class FakeEngine:
    """The AsyncEngine facade the worker uses, answering each request with `script(req)`
    (its output batches, the last one finishing it; an exception in their place is raised
    from `stream`, as an engine that died)."""

    script: Callable[[FakeRequest], list[list[EngineOutput]]] = field(
        default_factory=lambda: count_to(3))
    max_model_len: int = 64
    num_waiting: int = 0
    dead_error: BaseException | None = None
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    made: list[FakeRequest] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def make_request(self, request_id, prompt_token_ids, params, priority=0, *, kv=None,
                     presampled=0, grammar=None, lora=None) -> FakeRequest:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty")
        req = FakeRequest(request_id, list(prompt_token_ids), params, kv, presampled, priority)
        self.made.append(req)
        return req

    async def compile_grammar(self, structured):
        return None  # no grammar engine: constraints are not enforced here

    def submit(self, req: FakeRequest) -> asyncio.Queue:
        self.submitted.append(req.request_id)
        queue: asyncio.Queue = asyncio.Queue()
        for batch in self.script(req):
            queue.put_nowait(batch)
        return queue

    async def stream(self, request_id: str, queue: asyncio.Queue):
        finished = False
        try:
            while not finished:
                batch = await queue.get()
                if isinstance(batch, BaseException):  # the engine loop died
                    raise batch
                finished = batch[-1].finished
                yield batch
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def make_pipeline(engine: FakeEngine | None = None, max_waiting: int = 8,
                  tool_parser: str = "auto", priority_scheduling: bool = False
                  ) -> tuple[Pipeline, FakeEngine, WorkerMetrics]:
    engine = engine or FakeEngine()
    metrics = WorkerMetrics()
    serving = Serving(engine, metrics, max_waiting)
    fmt = OpenAIFormat(engine.tokenizer, MODEL, tool_parser)
    return (Pipeline(serving, fmt, priority_scheduling=priority_scheduling), engine,
            metrics)


def kv_params(num_tokens: int, first_token: int = 5) -> KVTransferParams:
    layout = KVLayoutInfo(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8,
                          dtype="bfloat16")
    return KVTransferParams(endpoint=KVEndpointInfo(transport="tcp", engine_id="e1",
                                                    address="127.0.0.1:1", layout=layout),
                            block_ids=[3], num_tokens=num_tokens, lease_id="lease-1",
                            first_token=first_token, lease_ttl_s=30.0)


def sse_events(raw: bytes) -> list[tuple[str, object]]:
    """An SSE body as (kind, data): kind "tokens" for token events, "data" for the rest
    (data parsed as JSON, or the literal "[DONE]")."""
    events = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        if block.startswith(b"event: baton.tokens\n"):
            events.append(("tokens", json.loads(block.split(b"\n", 1)[1][6:])))
        else:
            assert block.startswith(b"data: "), block
            data = block[6:]
            events.append(("data", "[DONE]" if data == b"[DONE]" else json.loads(data)))
    return events


async def asgi_call(app, method: str, path: str, body: object = None,
                    headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    """One request through the app (no lifespan): status, headers, the whole body. The
    client never disconnects."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json")] + [
                 (k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    messages: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # never disconnects

    async def send(message: dict) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start = messages[0]
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], head, b"".join(m.get("body", b"") for m in messages[1:])
