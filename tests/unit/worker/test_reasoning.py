"""The reasoning parser: a choice's thinking split from its answer, the same however the
text arrives (split at every position, in one piece or two cuts), markers held back until
they are certain, the answer alone read for tool calls, and the grammar gated on the
request's thinking."""

from __future__ import annotations

import json

import pytest

from baton.common.protocol import ChatCompletionRequest, parse_request
from baton.common.sampling_params import SamplingParams, StructuredOutput
from baton.worker.reasoning import (
    REASONING_PARSER_CHOICES,
    ReasoningFormat,
    ThinkingSplitter,
    chat_deltas,
    chat_message,
    resolve,
)
from baton.worker.tool_calls import ToolFormat
from tests.unit.engine.tiny_qwen3 import TEMPLATE

CASES = [  # output text -> (reasoning, answer)
    ("<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("no opening marker</think>answer", ("no opening marker", "answer")),
    ("all thinking, cut by max_tokens", ("all thinking, cut by max_tokens", "")),
    ("</think>", ("", "")),
    ("<think>", ("", "")),
    ("<thin", ("<thin", "")),  # not the marker after all: thinking text
    ("a </th b</think> c </think> d", ("a </th b", " c </think> d")),  # the first ends it
    ("x<think>y</think>z", ("x<think>y", "z")),  # a <think> after text is text
    ("<think></think>", ("", "")),
    ("</thin", ("</thin", "")),
]


def pieces_of(chunks: list[str]) -> tuple[str, str]:
    s = ThinkingSplitter()
    out = [p for c in chunks[:-1] for p in s.feed(c)] + s.feed(chunks[-1], finished=True)
    assert all(text for _, text in out)  # no empty pieces
    return ("".join(t for k, t in out if k == "reasoning"),
            "".join(t for k, t in out if k == "content"))


@pytest.mark.parametrize("text, expected", CASES)
def test_the_split_is_the_same_wherever_the_text_is_cut(text, expected):
    assert ThinkingSplitter().split(text) == expected
    for i in range(len(text) + 1):
        assert pieces_of([text[:i], text[i:]]) == expected, i
        for j in range(i, len(text) + 1):
            assert pieces_of([text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert pieces_of(list(text) + [""]) == expected  # a character at a time


def test_a_partial_marker_is_held_back_until_it_is_certain():
    s = ThinkingSplitter()
    assert s.feed("<th") == []  # may be the opening marker
    assert s.feed("ink>hmm </") == [("reasoning", "hmm ")]  # "</" may end the thinking
    assert s.feed("think>The") == [("content", "The")]
    assert s.feed(" end") == [("content", " end")] and not s.thinking


def test_parsers_and_auto_detection():
    from baton.cli_common import REASONING_PARSERS  # the CLI's choices, spelled out

    assert REASONING_PARSER_CHOICES == REASONING_PARSERS == ("none", "auto", "qwen3",
                                                            "deepseek_r1")
    assert resolve("auto", TEMPLATE) == "qwen3"
    assert resolve("auto", "{{'<｜Assistant｜><think>\\n'}}") == "deepseek_r1"
    assert resolve("auto", "{{ messages }}") is None and resolve("none", TEMPLATE) is None
    assert resolve("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        resolve("r1", TEMPLATE)


class MarkerTokenizer:
    chat_template = TEMPLATE

    def __init__(self, pieces: int = 1) -> None:
        self.pieces = pieces

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [401 + i for i in range(self.pieces)]


def chat(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body).encode())


def test_who_thinks_and_where_the_grammar_starts():
    qwen3, r1 = ReasoningFormat("qwen3", MarkerTokenizer()), ReasoningFormat(
        "deepseek_r1", MarkerTokenizer())
    off = chat(chat_template_kwargs={"enable_thinking": False})
    assert qwen3.thinks(chat()) and not qwen3.thinks(off) and r1.thinks(off)
    assert not ReasoningFormat("none", MarkerTokenizer()).thinks(chat())
    params = SamplingParams(structured=StructuredOutput("json_object"))
    assert qwen3.sampling_params(chat(), params).structured == StructuredOutput(
        "json_object", after_token=401)
    assert qwen3.sampling_params(off, params) is params  # starts in the answer: at once
    plain = SamplingParams()
    assert qwen3.sampling_params(chat(), plain) is plain
    assert qwen3.splitter(off) is None and qwen3.splitter(chat()) is not None
    with pytest.raises(ValueError, match="needs '</think>' as one token"):
        ReasoningFormat("qwen3", MarkerTokenizer(pieces=3))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_only_the_answer_is_read_for_tool_calls():
    text = f"<think>maybe {CALL} here?</think>\n\n{CALL}"  # a call in the thinking is text
    request = chat(tools=TOOLS)
    fmt = ToolFormat("hermes", TEMPLATE)
    message = chat_message(text, fmt.choice_tools(request), ThinkingSplitter())
    assert message["reasoning_content"] == f"maybe {CALL} here?"
    assert message["content"] == "\n\n" or message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Paris"}']
    tools, thinking, deltas = fmt.choice_tools(request), ThinkingSplitter(), []
    for i in range(0, len(text), 5):
        deltas += chat_deltas(text[i:i + 5], False, tools, thinking)
    deltas += chat_deltas("", True, tools, thinking)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == f"maybe {CALL} here?"
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas
            if "tool_calls" in d and "id" in d["tool_calls"][0]] == ["get_weather"]


def test_a_thinking_answer_with_no_other_text_has_null_content():
    assert chat_message("only thoughts", None, ThinkingSplitter()) == {
        "content": None, "reasoning_content": "only thoughts"}
    assert chat_message("plain", None, None) == {"content": "plain"}
    assert chat_deltas("plain", True, None, None) == [{"content": "plain"}]
