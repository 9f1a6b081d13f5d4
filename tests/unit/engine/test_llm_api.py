"""The offline API on the bundled model: chat, n, stop strings, seeds, logprobs, bad input."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.engine.errors import InvalidRequestError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=1024, num_kv_blocks=256)


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_stop_string_cuts_text_and_reports_reason(llm):
    base = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0].text
    stop = base.strip().split()[1]
    out = llm.generate("Count: one, two, three,",
                       SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base[: base.index(stop)]


def test_n_samples_differ_and_seeds_reproduce(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12)
    a = llm.generate("Write a word:", p, use_tqdm=False)[0]
    b = llm.generate("Write a word:", p, use_tqdm=False)[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_logprobs_and_max_tokens(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, logprobs=2,
                                               ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(lp.rank == 1 and lp.top[0][0] == lp.token_id for lp in out.logprobs)


def test_bad_input_is_rejected_before_anything_runs(llm):
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate(["ok", [5] * 1024], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside"):
        llm.generate([[1, 2, 10**6]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.num_used_blocks == 0


def test_output_is_capped_by_the_context_window(llm):
    out = llm.generate([[7] * 1020], SamplingParams(temperature=0, max_tokens=100,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_bfloat16_engine_answers_too():
    llm = LLM(dtype="bfloat16", num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
