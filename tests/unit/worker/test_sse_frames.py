"""The pre-framed text events (`worker/sse_frames.py`) are byte for byte the events the
pydantic models make, alone and through a whole stream."""

from __future__ import annotations

import asyncio

import pytest

from baton.common.internal import StreamHeader
from baton.common.responses import ChatChunkChoice, ResponseChunk, TextChoice
from baton.worker import openai_api
from baton.worker.openai_api import Answer, Internal
from baton.worker.sse_frames import TextFrames
from tests.unit.worker.fakes import FakeEngine, make_pipeline, out
from tests.unit.worker.test_openai_api import PROMPT, chat_request, completion_request

TEXTS = ["a", " the", "", "é ü ß", "日本語", "🙂 emoji", 'quote " and \\ backslash',
         "new\nline\ttab\r", "\x00\x01\x1f\x7f control", "\u2028\u2029 separators",
         "</script> & <b>", "{\"json\": [1, 2]}", "baton-text-0000"]


def slow(header: StreamHeader, chat: bool, index: int, text: str) -> bytes:
    if chat:
        choice = ChatChunkChoice.model_validate({"index": index, "delta": {"content": text},
                                                 "logprobs": None, "finish_reason": None})
    else:
        choice = TextChoice.model_validate({"index": index, "text": text, "logprobs": None,
                                            "finish_reason": None})
    return ResponseChunk.of(header, [choice]).dump_sse()


@pytest.mark.parametrize("chat", [True, False])
def test_a_frame_gives_the_models_bytes_for_any_text(chat):
    header = StreamHeader(id='cmpl-"odd\\id"', created=1_700_000_000, model="m/ü \"q\"",
                          object="chat.completion.chunk" if chat else "text_completion")
    frames = TextFrames(header, chat)
    for index in (0, 3, 0):
        for text in TEXTS:
            assert frames.event(index, text) == slow(header, chat, index, text)


def run(api, req, script, internal, plain: bool) -> list[bytes]:
    """The stream's raw chunks, with the pre-framed events (`plain`) or without."""
    pipeline, _, _ = make_pipeline(FakeEngine(script))
    serving = pipeline.serving

    async def main():
        jobs = serving.make_jobs("r", [PROMPT], req.to_sampling_params(), "prompt")
        answer = pipeline.format.answer(api, req, "r", [PROMPT], len(jobs), internal)
        answer.header = StreamHeader(id="r", object=answer.header.object, created=1,
                                     model=answer.header.model)
        answer.frames = TextFrames(answer.header, answer.chat)
        if not plain:
            answer._plain = lambda c, finished: False  # noqa: SLF001 - the slow path
        serving.admit(jobs)
        return [c async for c in openai_api.events(answer, serving.run(jobs))]
    return asyncio.run(main())


def script(r):
    return [[out(r.request_id, [10])], [out(r.request_id, [11], text="")],
            [out(r.request_id, [12], text="ü\n\"")],
            [out(r.request_id, [13, 14])],
            [out(r.request_id, [15], text="end", finish="length")]]


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("internal", [openai_api.PUBLIC, Internal(True)])
def test_a_stream_is_the_same_bytes_with_or_without_frames(api, internal):
    body = {"stream": True, "n": 2}
    req = chat_request(**body) if api == "chat" else completion_request(**body)
    fast = run(api, req, script, internal, plain=True)
    assert fast == run(api, req, script, internal, plain=False)
    assert any(b'"content":"\\u00fc' in c or b'\xc3\xbc\\n\\"' in c for c in fast)


def test_only_plain_text_updates_take_frames():
    req = completion_request(stream=True, logprobs=1)
    pipeline, _, _ = make_pipeline(FakeEngine(script))
    answer: Answer = pipeline.format.answer("completions", req, "r", [PROMPT], 1,
                                            openai_api.PUBLIC)
    choice = answer.choices[0]
    choice.add([out("r-0", [10])])
    assert not answer._plain(choice, False)  # noqa: SLF001 - logprobs asked for
    answer.want_logprobs = False
    assert answer._plain(choice, False)  # noqa: SLF001
    assert not answer._plain(choice, True)  # noqa: SLF001 - the finish shows its reason
    choice.add([out("r-0", [11], text="")])
    assert not answer._plain(choice, False)  # noqa: SLF001 - nothing to show
