"""The router's stream tracker: internal fields out, tokens remembered, continuation bodies."""

from __future__ import annotations

import json

from baton.router.resume import DecodeCall, StreamTracker


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def chunk(text, ids, finish=None):
    return BASE | {"choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                "finish_reason": finish, "token_ids": ids}]}


def test_strips_internal_fields_across_split_reads():
    call = DecodeCall("chat", {"model": "m", "messages": [], "stream": True,
                               "max_tokens": 10, "min_tokens": 4})
    assert call.resumable and json.loads(call.body())["return_token_ids"] is True
    t = StreamTracker(call)
    role = BASE | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}],
                   "prompt_token_ids": [1, 2, 3]}
    raw = ev(role) + ev(chunk("Hel", [5])) + ev(chunk("", [6])) + ev(chunk("lo", [7]))
    out = b"".join(t.feed(raw[i:i + 7]) for i in range(0, len(raw), 7))
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line]
    assert [e["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}]
    assert not any("token_ids" in json.dumps(e) for e in events)  # nor prompt_token_ids
    assert t.prompt_ids == [1, 2, 3] and t.sent == [5, 6, 7] and t.text_len == 5
    assert t.can_resume and not t.exhausted
    body = json.loads(t.continuation())
    assert body["prompt_token_ids"] == [1, 2, 3, 5, 6, 7]
    assert body["request"]["max_tokens"] == 7 and body["request"]["min_tokens"] == 1
    assert body["resume"] == {"prompt_tokens": 3, "completion_tokens": 3, "text_offset": 5,
                              "created": 7}
    t.feed(ev(chunk(".", [8], "stop")))
    assert t.finished and not t.can_resume


def test_not_resumable_and_exhausted_cases():
    assert not DecodeCall("chat", {"stream": False}).resumable
    assert not DecodeCall("chat", {"stream": True, "n": 2}).resumable
    assert not DecodeCall("completions", {"stream": True, "prompt": ["a", "b"]}).resumable
    assert DecodeCall("completions", {"stream": True, "prompt": [1, 2]}).resumable
    call = DecodeCall("completions", {"model": "m", "prompt": "x", "stream": True,
                                      "echo": True, "max_tokens": 2,
                                      "stream_options": {"include_usage": True}})
    t = StreamTracker(call)
    base = {"id": "cmpl-1", "object": "text_completion", "created": 3, "model": "m"}
    first = base | {"choices": [{"index": 0, "text": "", "logprobs": None,
                                 "finish_reason": None}], "prompt_token_ids": [9]}
    t.feed(ev(first) + ev(base | {"choices": [{"index": 0, "text": "ab", "logprobs": None,
                                               "finish_reason": None,
                                               "token_ids": [4, 5]}]}))
    assert t.exhausted  # both tokens sent; only the finish event was lost
    tail = t.closing_events().decode()
    assert '"finish_reason": "length"' in tail and tail.endswith("data: [DONE]\n\n")
    assert '"completion_tokens": 2' in tail
    body = json.loads(t.continuation())
    assert body["request"]["echo"] is False
