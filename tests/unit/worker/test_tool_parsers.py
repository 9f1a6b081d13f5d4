"""Tool-call parsers on realistic model outputs: the calls and the content they find, the
same whether the text arrives whole or in any pieces, and prose left alone."""

from __future__ import annotations

import json
import random

import pytest

from baton.worker.tool_parsers import (
    PARSER_CHOICES,
    PARSERS,
    CallArgs,
    CallStart,
    Content,
    NamedCallParser,
    RequiredCallsParser,
    detect,
    resolve,
)
from baton.worker.tool_parsers.hermes import HermesParser
from baton.worker.tool_parsers.llama3_json import Llama3JsonParser
from baton.worker.tool_parsers.mistral import MistralParser

WEATHER = {"city": "Paris", "when": {"day": "tomorrow", "hours": [9, 12]},
           "note": "say \"hi\" }{ ]["}


def read(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) calls a parser finds in `pieces`."""
    events = [ev for piece in pieces for ev in parser.feed(piece)] + parser.finish()
    content = "".join(ev.text for ev in events if isinstance(ev, Content))
    calls: dict[int, list[str]] = {}
    for ev in events:
        if isinstance(ev, CallStart):
            assert ev.index == len(calls)  # calls start in order, once each
            calls[ev.index] = [ev.name, ""]
        elif isinstance(ev, CallArgs):
            calls[ev.index][1] += ev.text
    return content, [tuple(c) for c in calls.values()]


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check(parser_cls, text: str, content: str, calls: list[tuple[str, object]]) -> None:
    """Whole and in 50 random splits (one character at a time among them), the parser
    finds `content` and `calls` (arguments compared as JSON)."""
    rng = random.Random(text)
    for pieces in [[text], list(text)] + [split(text, rng) for _ in range(50)]:
        got_content, got_calls = read(parser_cls(), pieces)
        assert got_content == content, pieces
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, pieces


def test_hermes_several_calls_with_nested_arguments_after_text():
    text = ("I'll check both.\n<tool_call>\n"
            f'{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
            "</tool_call>")
    check(HermesParser, text, "I'll check both.",
          [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})])


def test_hermes_arguments_keep_the_models_own_text():
    text = '<tool_call>\n{"name": "f", "arguments": {"a":  1,"b" : [true, null]}}\n</tool_call>'
    assert read(HermesParser(), [text]) == ("", [("f", '{"a":  1,"b" : [true, null]}')])


def test_hermes_prose_and_broken_calls_stay_content():
    check(HermesParser, "No tools needed: 2 + 2 = 4.\n", "No tools needed: 2 + 2 = 4.\n", [])
    prose = "Write <tool_call> then JSON, like <tool_call>this</tool_call>."
    check(HermesParser, prose, prose, [])
    truncated = '<tool_call>\n{"name": "get_wea'  # cut before the call was certain
    check(HermesParser, truncated, truncated, [])


def test_hermes_call_cut_in_its_arguments_keeps_what_came():
    content, calls = read(HermesParser(), ['<tool_call>{"name": "f", "arguments": {"a": [1,'])
    assert (content, calls) == ("", [("f", '{"a": [1,')])


def test_hermes_text_after_the_calls_and_arguments_before_the_name():
    text = ('<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>\n\n'
            "Searching now.")
    check(HermesParser, text, "Searching now.", [("search", {"q": "x"})])
    check(HermesParser, '<tool_call>{"name": "now"}</tool_call>', "", [("now", {})])


def test_llama3_json_calls_at_the_start_only():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    check(Llama3JsonParser, one, "", [("get_weather", {"city": "Paris"})])
    two = ('<|python_tag|>{"type": "function", "name": "a", "parameters": {"x": 1}}; '
           '{"name": "b", "arguments": {}}')
    check(Llama3JsonParser, two, "", [("a", {"x": 1}), ("b", {})])
    later = 'Sure: {"name": "a", "parameters": {}}'
    check(Llama3JsonParser, later, later, [])


def test_llama3_json_answers_that_are_json_are_content():
    for text in ('{"city": "Paris", "temperature": 21}', '  {"name": "Bob", "age": 42}',
                 '{"name": 7}', "{not json}"):
        check(Llama3JsonParser, text, text, [])


def test_mistral_array_of_calls():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": '
            f'{json.dumps(WEATHER)}}}, {{"name": "get_time", "arguments": {{}}}}]')
    check(MistralParser, text, "", [("get_weather", WEATHER), ("get_time", {})])
    check(MistralParser, 'Let me look.[TOOL_CALLS][{"name": "a", "arguments": {"k": "v"}}]',
          "Let me look.", [("a", {"k": "v"})])
    assert MistralParser.keeps_special_tokens
    assert len(MistralParser.call_id()) == 9 and MistralParser.call_id().isalnum()


def test_forced_required_array_and_named_arguments():
    text = ' [{"name": "a", "parameters": {"x": 1.5e3}}, {"name": "b", "parameters": {}}] '
    check(RequiredCallsParser, text, "", [("a", {"x": 1500.0}), ("b", {})])
    check(lambda: NamedCallParser("f"), '\n {"x": [1, 2]}\n', "", [("f", {"x": [1, 2]})])
    assert read(NamedCallParser("f"), []) == ("", [("f", "")])  # a call even if cut at once


def test_detect_from_the_chat_template():
    assert detect("{% for m in messages %}<tool_call>{% endfor %}") == "hermes"
    assert detect("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert detect("<|start_header_id|>ipython<|end_header_id|><|python_tag|>") == "llama3_json"
    assert detect("{{ message['content'] }}") == detect(None) == "hermes"
    assert resolve("auto", "x[TOOL_CALLS]") is MistralParser
    assert resolve("none", "<tool_call>") is None
    assert set(PARSER_CHOICES) == {"auto", "none", *PARSERS}
    with pytest.raises(ValueError, match="hermes"):
        resolve("qwen", None)


def test_the_flag_takes_the_parsers_and_reaches_the_settings():
    from baton.cli import _worker_settings, build_parser
    from baton.cli_common import TOOL_CALL_PARSERS, worker_flag_args
    from baton.engine.config import EngineConfig

    assert TOOL_CALL_PARSERS == PARSER_CHOICES
    args = build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert _worker_settings(args, EngineConfig(), frozenset()).tool_call_parser == "mistral"
    passed = worker_flag_args(args)  # what `baton up` gives its workers
    assert passed[passed.index("--tool-call-parser") + 1] == "mistral"
    default = build_parser().parse_args(["serve"])
    assert _worker_settings(default, EngineConfig(), frozenset()).tool_call_parser == "auto"
