"""The router's stream tracker: token events out, tokens counted once their content went out,
continuation bodies."""

from __future__ import annotations

import json

import pytest

from baton.common.internal import GenerateRequest, ResumeState, StreamHeader, TokenEvent
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.router.resume import DecodeCall, StreamTracker

CHAT = StreamHeader(id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m")
CMPL = StreamHeader(id="cmpl-1", object="text_completion", created=3, model="m")


def make_call(api: str, **body) -> DecodeCall:
    body.setdefault("model", "m")
    if api == "chat":
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    model = ChatCompletionRequest if api == "chat" else CompletionRequest
    return DecodeCall(api, parse_request(model, json.dumps(body).encode()))


def ev(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def tokens(ids=(), chars=0, finished=False, **first) -> bytes:
    return TokenEvent(token_ids=list(ids), text_chars=chars, finished=finished, **first).sse()


def delta(text, finish=None, header=CHAT, **extra) -> bytes:
    return ev(header.model_dump() | {"choices": [
        {"index": 0, "delta": {"content": text, **extra}, "logprobs": None,
         "finish_reason": finish}]})


def text(t, finish=None) -> bytes:
    return ev(CMPL.model_dump() | {"choices": [
        {"index": 0, "text": t, "logprobs": None, "finish_reason": finish}]})


def feed_in_pieces(t: StreamTracker, raw: bytes, size: int = 7) -> bytes:
    return b"".join(t.feed(raw[i:i + size]) for i in range(0, len(raw), size))


def test_token_events_are_dropped_and_counted_across_split_reads():
    call = make_call("chat", stream=True, max_tokens=10, min_tokens=4)
    assert call.resumable and json.loads(call.body())["return_token_ids"] is True
    t = StreamTracker(call)
    role = delta("", role="assistant")
    content = [role, delta("Hel"), delta("lo")]
    raw = (tokens(prompt_token_ids=[1, 2, 3], header=CHAT) + role
           + tokens([5], 3) + content[1]
           + tokens([6]) + tokens([7], 2) + content[2])  # [6] has no text of its own
    out = feed_in_pieces(t, raw)
    assert out == b"".join(content)  # the content events, byte for byte, never re-encoded
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line]
    assert [e["choices"][0]["delta"] for e in events] == [
        {"content": "", "role": "assistant"}, {"content": "Hel"}, {"content": "lo"}]
    assert b"token_ids" not in out and b"baton.tokens" not in out  # nor prompt_token_ids
    assert t.prompt_ids == [1, 2, 3] and t.sent == [5, 6, 7] and t.text_len == 5
    assert t.header == CHAT and t.can_resume and not t.exhausted
    body = GenerateRequest.model_validate_json(t.continuation())
    assert body.api == "chat" and body.return_token_ids and body.kv_transfer_params is None
    assert body.prompt_token_ids == [1, 2, 3, 5, 6, 7]
    assert body.request.max_tokens == 7 and body.request.min_tokens == 1
    assert body.request.messages == call.request.messages and body.request.stream
    assert body.resume == ResumeState(prompt_tokens=3, completion_tokens=3, text_offset=5,
                                      created=7)
    t.feed(tokens([8], 1, finished=True) + delta(".", "stop"))
    assert t.finished and not t.can_resume and t.sent == [5, 6, 7, 8]


def test_tokens_count_as_sent_only_once_their_content_event_went_out():
    call = make_call("chat", stream=True, max_completion_tokens=5)
    t = StreamTracker(call)
    assert t.feed(tokens(prompt_token_ids=[1, 2], header=CHAT)) == b""
    assert not t.can_resume  # the client has seen nothing yet: nothing to continue
    t.feed(delta("", role="assistant") + tokens([5], 1) + delta("a"))
    assert t.sent == [5] and t.text_len == 1 and t.can_resume
    # The pod dies between a token event and its content: those tokens were not sent ...
    assert t.feed(tokens([6, 7], 2) + tokens([8], 1, finished=True)) == b""
    assert t.sent == [5] and t.text_len == 1 and t.can_resume and not t.finished
    body = GenerateRequest.model_validate_json(t.continuation())
    assert body.prompt_token_ids == [1, 2, 5] and body.request.max_completion_tokens == 4
    assert body.resume == ResumeState(prompt_tokens=2, completion_tokens=1, text_offset=1,
                                      created=7)
    # ... and are not committed by the next pod's first content event either.
    resumed = CHAT.model_copy(update={"id": "chatcmpl-2"})
    out = t.feed(tokens(prompt_token_ids=[1, 2, 5], header=resumed)
                 + tokens([6], 1) + delta("b"))
    assert out == delta("b") and t.sent == [5, 6] and t.text_len == 2
    assert t.prompt_ids == [1, 2] and t.header == CHAT  # the stream's own, kept
    assert GenerateRequest.model_validate_json(t.continuation()).request \
        .max_completion_tokens == 3


def test_errors_done_and_other_events_pass_through_unparsed():
    t = StreamTracker(make_call("chat", stream=True))
    keepalive = b": keepalive\n\n"
    error = b'data: {"error":{"message":"boom","type":"internal_server_error"}}\n\n'
    assert t.feed(keepalive + tokens([5], 1)) == keepalive
    assert t.feed(error) == error and t.finished and t.sent == []
    t = StreamTracker(make_call("chat", stream=True))
    assert t.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n" and t.finished
    with pytest.raises(ValueError, match="baton.tokens"):
        StreamTracker(make_call("chat", stream=True)).feed(b"event: baton.tokens\n\n")


def test_completions_continuation_drops_echo():
    call = make_call("completions", prompt="x", stream=True, echo=True, max_tokens=3)
    t = StreamTracker(call)
    t.feed(tokens(prompt_token_ids=[9], header=CMPL, chars=1) + text("x")  # the echo
           + tokens([4, 5], 2) + text("ab"))
    assert t.sent == [4, 5] and t.text_len == 3 and not t.exhausted
    body = GenerateRequest.model_validate_json(t.continuation())
    assert body.request.echo is False and body.request.max_tokens == 1
    assert body.request.prompt == "x" and body.prompt_token_ids == [9, 4, 5]
    assert body.resume == ResumeState(prompt_tokens=1, completion_tokens=2, text_offset=3,
                                      created=3)


def test_a_continuation_keeps_the_lora_adapter_the_request_named():
    """A LoRA request resumes under its adapter (the new pod applies it to the prompt and
    the tokens already sent, and the router picks only pods serving it)."""
    call = make_call("chat", model="sql-adapter", stream=True, max_tokens=4)
    t = StreamTracker(call)
    t.feed(tokens(prompt_token_ids=[1, 2], header=CHAT) + tokens([7], 1) + delta("a"))
    body = GenerateRequest.model_validate_json(t.continuation())
    assert body.request.model == "sql-adapter" and body.prompt_token_ids == [1, 2, 7]


def test_not_resumable_and_exhausted_cases():
    assert not make_call("chat", stream=False).resumable
    assert not make_call("chat", stream=True, n=2).resumable
    assert not make_call("completions", stream=True, prompt=["a", "b"]).resumable
    assert make_call("completions", stream=True, prompt=[1, 2]).resumable
    assert make_call("completions", stream=True, prompt=["a"]).resumable
    assert json.loads(make_call("chat", stream=False).body())["return_token_ids"] is False
    call = make_call("completions", prompt="x", stream=True, max_tokens=2,
                     stream_options={"include_usage": True})
    t = StreamTracker(call)
    t.feed(tokens(prompt_token_ids=[9], header=CMPL) + text("")
           + tokens([4, 5], 2) + text("ab"))
    assert t.exhausted  # both tokens sent; only the finish event was lost
    tail = t.closing_events().decode()
    events = [json.loads(e[6:]) for e in tail.split("\n\n") if e and e != "data: [DONE]"]
    assert tail.endswith("data: [DONE]\n\n") and t.finished
    assert events[0] == CMPL.model_dump() | {"choices": [
        {"index": 0, "logprobs": None, "finish_reason": "length", "text": ""}]}
    assert events[1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 2,
                                  "total_tokens": 3}
