"""An async streaming client for any OpenAI-compatible endpoint, timing every token.

Per request it records when it was sent, the time to the first content (TTFT), every gap
between content events (ITL), the end-to-end latency, tokens in and out (from the stream's
usage chunk when the server sends one, else counted events), the HTTP status and any error.
A request is `ok` only if it got a 200 and a complete stream ending in `[DONE]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from baton_loadtest.generator import PlannedRequest


@dataclass
class RequestRecord:
    index: int
    sent_s: float  # offset from the start of the run
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    session: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.e2e_s is None or self.ttft_s is None or not self.output_tokens \
                or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return asdict(self) | {"tpot_s": self.tpot_s}

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        d = dict(d)
        d.pop("tpot_s", None)
        return cls(**d)


@dataclass(frozen=True)
class ClientSettings:
    base_url: str
    model: str
    api: str = "chat"  # or "completions"
    ignore_eos: bool = True  # exact output lengths (vLLM/SGLang/Baton extension)
    temperature: float | None = 0.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api={self.api!r} must be 'chat' or 'completions'")


class OpenAIStreamClient:
    def __init__(self, settings: ClientSettings, session: aiohttp.ClientSession) -> None:
        self.s = settings
        self.session = session
        base = settings.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        self.url = base + ("/chat/completions" if settings.api == "chat" else "/completions")
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)

    def body(self, req: PlannedRequest) -> bytes:
        b = {"model": self.s.model, "max_tokens": req.max_tokens, "stream": True,
             "stream_options": {"include_usage": True}}
        if self.s.api == "chat":
            b["messages"] = req.messages
        else:
            b["prompt"] = req.prompt
        if self.s.ignore_eos:
            b["ignore_eos"] = True
        if self.s.temperature is not None:
            b["temperature"] = self.s.temperature
        return json.dumps(b).encode()

    async def send(self, req: PlannedRequest, t0: float) -> RequestRecord:
        """Send one request; t0 is the run's start on the perf_counter clock."""
        chat = self.s.api == "chat"
        start = time.perf_counter()
        rec = RequestRecord(req.index, start - t0, session=req.session)
        last = None
        events = 0
        try:
            async with self.session.post(self.url, data=self.body(req), timeout=self._timeout,
                                         headers={"Content-Type": "application/json"}) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    rec.error = (await resp.text())[:500]
                    return rec
                done = False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True  # read on to the end so the connection can be reused
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = json.dumps(event["error"])[:500]
                        return rec
                    if event.get("usage"):
                        rec.prompt_tokens = event["usage"].get("prompt_tokens")
                        rec.output_tokens = event["usage"].get("completion_tokens")
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if chat \
                            else choice.get("text")
                        if text:
                            now = time.perf_counter()
                            if last is None:
                                rec.ttft_s = now - start
                            else:
                                rec.itl_s.append(now - last)
                            last = now
                            events += 1
                if not done:
                    rec.error = "the stream ended without [DONE]"
                    return rec
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as err:
            rec.error = f"{type(err).__name__}: {err}"[:500]
            return rec
        rec.e2e_s = time.perf_counter() - start
        if rec.output_tokens is None:
            rec.output_tokens = events
        rec.ok = True
        return rec
