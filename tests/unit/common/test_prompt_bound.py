"""The most characters a prompt that fits can have (issue 38): a sound bound from the
tokenizer's longest vocabulary string, loosened for composing normalizers, none for a
tokenizer that may drop text; checked against the real tokenizer on adversarial text."""

from __future__ import annotations

import json

import pytest

from baton.common.prompt_bound import COMPOSING_SLACK, max_prompt_chars


@pytest.fixture(scope="module")
def smollm_json() -> str:
    from baton.engine.models.loader import resolve_model_dir

    return (resolve_model_dir(None) / "tokenizer.json").read_text()


def with_parts(spec: str, **parts) -> str:
    return json.dumps(json.loads(spec) | parts)


def test_the_bound_is_the_context_times_the_longest_token(smollm_json):
    vocab = json.loads(smollm_json)["model"]["vocab"]
    longest = max(len(k) for k in vocab)
    assert max_prompt_chars(smollm_json, 100) == 100 * longest
    nfc = with_parts(smollm_json, normalizer={"type": "NFC"})
    assert max_prompt_chars(nfc, 100) == 100 * longest * COMPOSING_SLACK


@pytest.mark.parametrize("parts", [
    {"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}},
    {"normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}]}},
    {"pre_tokenizer": {"type": "WhitespaceSplit"}},
    {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}},
])
def test_a_tokenizer_that_may_drop_text_has_no_bound(smollm_json, parts):
    assert max_prompt_chars(with_parts(smollm_json, **parts), 100) is None


@pytest.mark.parametrize("text", ["#" * 5000, " " * 5000, "\n" + " " * 4999,
                                  "hello world " * 400, "é" * 3000, "日本語" * 1000])
def test_no_text_has_fewer_tokens_than_the_bound_says(smollm_json, text):
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(smollm_json)
    tokens = len(tok.encode(text, add_special_tokens=False).ids)
    bound = max_prompt_chars(smollm_json, tokens)
    assert bound is not None and len(text) <= bound  # fewer tokens could not hold it
