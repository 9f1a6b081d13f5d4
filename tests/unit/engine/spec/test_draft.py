"""Draft-model speculation (`engine.spec.draft`) on tiny random Llamas built by transformers:
greedy tokens equal the target's alone, with a different draft (few guesses kept) and with
the target as its own draft (every guess kept); a draft of another vocabulary, or a draft
named without the method, is refused."""

from __future__ import annotations

import json

import pytest

from baton import LLM, SamplingParams
from tests.unit.engine.tiny_checkpoint import save_tiny_llama

PROMPTS = [{"prompt_token_ids": [1] + [(7 * i + 3 * j) % 900 + 10 for j in range(12 + 5 * i)]}
           for i in range(5)]
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("target"), seed=0)


def _llm(model, draft=None, k: int = 3) -> LLM:
    spec = None if draft is None else json.dumps(
        {"method": "draft_model", "draft_model": str(draft), "num_speculative_tokens": k,
         "disable_by_batch_size": 16})
    return LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256,
               speculative_config=spec)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(target_dir):
    return _tokens(_llm(target_dir))


def test_another_draft_changes_nothing(tmp_path, target_dir, reference):
    llm = _llm(target_dir, save_tiny_llama(tmp_path / "draft", seed=5))
    assert _tokens(llm) == reference
    c = llm.engine.speculator.counters
    assert c.proposed_tokens > 0 and c.accepted_tokens < c.proposed_tokens
    assert llm.engine.speculator.draft.kv.num_used_blocks == 0  # shadows freed with requests


def test_the_target_as_its_own_draft_is_always_right(target_dir, reference):
    llm = _llm(target_dir, target_dir, k=4)
    assert _tokens(llm) == reference
    c = llm.engine.speculator.counters
    assert c.proposed_tokens > 100 and c.accepted_tokens == c.proposed_tokens
    assert llm.engine.stats.steps_total < sum(len(t) for t in reference) / 3


def test_a_draft_must_share_the_vocabulary(tmp_path, target_dir):
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(target_dir, save_tiny_llama(tmp_path / "other", vocab=999))
    with pytest.raises(ValueError, match="draft_model"):
        LLM(model=str(target_dir), skip_tokenizer_init=True,
            speculative_config='{"method": "draft_model"}')
