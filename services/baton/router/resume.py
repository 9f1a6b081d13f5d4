"""Decode pods behind the router: their request body, and resuming a stream a pod dropped.

A decode pod gets `/internal/generate` with the OpenAI request, the prompt's token ids and
`kv_transfer_params` when a prefill pod ran, and — for a stream that could be resumed (one
prompt, `n` = 1) — `return_token_ids`, so that every chunk names the tokens it carries.
`StreamTracker` reads that stream on its way to the client: it takes the internal fields
out (the client sees a plain OpenAI stream) and remembers the prompt ids, the tokens sent,
the text length, the response id and `created`. If the pod dies mid-stream, `continuation()`
is the body that makes another decode pod go on from prompt + tokens sent, with
`max_tokens` and `min_tokens` reduced by what was sent and `resume` bookkeeping so its
usage, id and offsets continue the same stream; the client sees one stream.

What a resumption cannot keep: a seeded sampler restarts its random sequence (greedy output
is exact), and a stop string that straddles the break is not matched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class DecodeCall:
    api: str  # "chat" | "completions"
    request: dict  # the client's OpenAI body
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict | None = None
    preferred: object | None = field(default=None, repr=False)  # the decode pod picked first
    prefill_s: float = 0.0  # how long the remote prefill took (0 when local)

    @property
    def resumable(self) -> bool:
        r = self.request
        if not r.get("stream") or r.get("n", 1) != 1:
            return False
        prompt = r.get("prompt")
        one_prompt = self.api == "chat" or isinstance(prompt, str) or (
            isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)
                                          or len(prompt) == 1))
        return one_prompt

    def body(self) -> bytes:
        return json.dumps({"api": self.api, "request": self.request,
                           "prompt_token_ids": self.prompt_token_ids,
                           "kv_transfer_params": self.kv_transfer_params,
                           "return_token_ids": self.resumable}).encode()


class StreamTracker:
    def __init__(self, call: DecodeCall) -> None:
        self.call = call
        self.prompt_ids = call.prompt_token_ids
        self.sent: list[int] = []
        self.text_len = 0
        self.finished = False  # a finish_reason, an in-band error or [DONE] went out
        self.base: dict | None = None  # id / object / created / model of the stream
        self.resumes = 0
        self._buf = b""

    # -- relaying --------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """Whole events of `chunk` (plus what was left of the last one), made public."""
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for event in events:
            public = self._event(event)
            if public is not None:
                out.append(public + b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data: "):
            return event
        data = event[6:]
        if data == b"[DONE]":
            self.finished = True
            return event
        obj = json.loads(data)
        if "error" in obj:
            self.finished = True
            return event
        ids = obj.pop("prompt_token_ids", None)
        if ids is not None and self.prompt_ids is None:
            self.prompt_ids = ids
        if self.base is None:
            self.base = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        keep = not obj.get("choices")  # the usage chunk
        for choice in obj.get("choices", ()):
            self.sent += choice.pop("token_ids", [])
            if choice.get("finish_reason") is not None:
                self.finished = True
            text = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
            self.text_len += len(text or "")
            keep = keep or bool(text) or choice.get("finish_reason") is not None \
                or choice.get("logprobs") is not None or "role" in choice.get("delta", {})
        if not keep:
            return None  # only token ids: nothing for the client
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode()

    # -- resuming --------------------------------------------------------------------------
    @property
    def can_resume(self) -> bool:
        return not self.finished and self.prompt_ids is not None and self.base is not None

    def _budget(self) -> int | None:
        r = self.call.request
        if self.call.api == "completions":
            limit = r.get("max_tokens", 16)  # OpenAI's completions default
        else:
            limit = r.get("max_completion_tokens") or r.get("max_tokens")
        return None if limit is None else limit - len(self.sent)

    @property
    def exhausted(self) -> bool:
        left = self._budget()
        return left is not None and left <= 0

    def continuation(self) -> bytes:
        """The body for another decode pod's /internal/generate."""
        request = dict(self.call.request)
        left = self._budget()
        if self.call.api == "completions":
            request["max_tokens"] = left
            request["echo"] = False
        elif request.get("max_completion_tokens") is not None:
            request["max_completion_tokens"] = left
        elif request.get("max_tokens") is not None:
            request["max_tokens"] = left
        if request.get("min_tokens"):
            request["min_tokens"] = max(0, request["min_tokens"] - len(self.sent))
        self._buf = b""  # a partial event of the dead stream is lost with it
        return json.dumps({
            "api": self.call.api, "request": request,
            "prompt_token_ids": self.prompt_ids + self.sent, "kv_transfer_params": None,
            "return_token_ids": True,
            "resume": {"prompt_tokens": len(self.prompt_ids),
                       "completion_tokens": len(self.sent), "text_offset": self.text_len,
                       "created": self.base.get("created")}}).encode()

    def closing_events(self) -> bytes:
        """When the pod died after the last allowed token but before saying so: the
        finish event (and usage, when asked for) and [DONE]."""
        choice = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.call.api == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        events = [self.base | {"choices": [choice]}]
        if (self.call.request.get("stream_options") or {}).get("include_usage"):
            p, c = len(self.prompt_ids), len(self.sent)
            events.append(self.base | {"choices": [], "usage": {
                "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
        self.finished = True
        return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) \
            + b"data: [DONE]\n\n"
