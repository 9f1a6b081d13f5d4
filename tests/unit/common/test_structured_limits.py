"""A request's schema and grammar are bounded before any of them is checked or compiled
(issue 38): each bound is a 400 naming the field and the limit, and is checked in time
bounded by the limits, not by the schema."""

from __future__ import annotations

import json
import time

import pytest

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest, parse_request
from baton.common.structured_limits import (
    MAX_GRAMMAR_CHARS,
    MAX_OPTIONAL_PROPERTIES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
)


def body(**extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       **extra}).encode()


def props(n: int, required: int = 0) -> dict:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "integer"} for k in names},
            "required": names[:required]}


def refused(raw: bytes) -> OpenAIError:
    with pytest.raises(OpenAIError) as err:
        parse_request(ChatCompletionRequest, raw)
    assert err.value.status == 400
    return err.value


def deep(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema,needle", [
    (props(MAX_OPTIONAL_PROPERTIES + 1), f"at most {MAX_OPTIONAL_PROPERTIES} are allowed"),
    ({"anyOf": [{"type": "string"}] * MAX_SCHEMA_NODES}, f"at most {MAX_SCHEMA_NODES}"),
    (deep(MAX_SCHEMA_DEPTH), f"more than {MAX_SCHEMA_DEPTH} deep"),
    ({"type": "string", "description": "x" * (2 << 20)}, "characters together"),
])
def test_a_schema_past_a_bound_is_a_400_naming_the_field_and_the_bound(schema, needle):
    err = refused(body(guided_json=schema))
    assert err.param == "guided_json" and needle in err.message
    err = refused(body(response_format={"type": "json_schema",
                                        "json_schema": {"name": "s", "schema": schema}}))
    assert err.param == "response_format.json_schema.schema" and needle in err.message


def test_required_properties_do_not_count_against_the_width():
    parse_request(ChatCompletionRequest,
                  body(guided_json=props(MAX_OPTIONAL_PROPERTIES + 500, required=500)))


def test_a_huge_schema_is_refused_in_bounded_time():
    raw = body(guided_json={"anyOf": [{"type": "string", "maxLength": i}
                                      for i in range(200_000)]})  # ~7 MB
    t0 = time.monotonic()
    refused(raw)
    assert time.monotonic() - t0 < 2  # the metaschema check never ran over it


def test_a_grammar_longer_than_its_bound_is_a_400():
    err = refused(body(guided_grammar="start: " + "a" * MAX_GRAMMAR_CHARS))
    assert err.param == "guided_grammar" and str(MAX_GRAMMAR_CHARS) in err.message
