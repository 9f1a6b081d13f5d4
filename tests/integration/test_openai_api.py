"""The openai client through the router gets exactly what LLM.generate gives in-process."""

from __future__ import annotations

import time

import pytest

from baton import SamplingParams
from tests.integration.conftest import MODEL, assert_idle

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,"]


def ref_chat(llm, messages, **kw):
    return llm.chat(messages, SamplingParams(**kw), use_tqdm=False)[0]


def ref_gen(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_greedy_matches_llm(client, reference_llm, messages):
    ref = ref_chat(reference_llm, messages, temperature=0, max_tokens=24)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=24)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks, times = [], []
    for c in stream:
        chunks.append(c)
        if c.choices and c.choices[0].delta.content:
            times.append(time.monotonic())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert finals == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        ref.outputs[0].token_ids)
    # Tokens arrive over time, not as one buffered blob at the end. (The worker merges the
    # deltas of steps that finished while its event loop was busy, so not one per token.)
    assert len(times) >= 3 and times[-1] - times[0] >= 0.02


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_greedy_matches_llm(client, reference_llm, prompt):
    ref = ref_gen(reference_llm, prompt, temperature=0, max_tokens=20)
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                            max_tokens=20, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text


def test_token_id_prompt_echo_and_batch(client, reference_llm):
    ids = reference_llm.get_tokenizer().encode("The capital of Italy is")
    ref = ref_gen(reference_llm, {"prompt_token_ids": ids}, temperature=0, max_tokens=8)
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8,
                                  echo=True)
    assert r.choices[0].text == "The capital of Italy is" + ref.outputs[0].text
    # Two prompts, n=2 each: four choices, indexed prompt-major.
    r = client.completions.create(model=MODEL, prompt=["Hello", "The capital of Italy is"],
                                  temperature=0, max_tokens=8, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[2].text == r.choices[3].text == ref.outputs[0].text


def test_n2_seeded_sampling_matches_llm(client, reference_llm):
    messages = CHATS[0]
    ref = reference_llm.chat(messages, SamplingParams(n=2, temperature=0.9, seed=7,
                                                      max_tokens=16), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=0.9,
                                       seed=7, max_tokens=16)
    assert [c.message.content for c in r.choices] == [o.text for o in ref.outputs]
    assert r.choices[0].message.content != r.choices[1].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, n=2,
                                            temperature=0.9, seed=7, max_tokens=16,
                                            stream=True)
    texts = ["", ""]
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [o.text for o in ref.outputs]


def test_stop_strings_and_max_completion_tokens(client, reference_llm):
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    full = ref_chat(reference_llm, messages, temperature=0, max_tokens=40).outputs[0].text
    assert "5" in full
    stop = full[full.index("5"):full.index("5") + 1]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=40, stop=[stop])
    assert r.choices[0].message.content == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_logprobs(client, reference_llm):
    messages = CHATS[0]
    ref = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                             use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for got, want in zip(content, ref.logprobs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert len(got.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert got.top_logprobs[0].token == got.token
        assert bytes(got.bytes).decode() == got.token
    c = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0,
                                  max_tokens=4, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.token_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_models_endpoint_aggregates(client, cluster):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert_idle(cluster.workers)


def test_nulls_and_a_replayed_answer_from_the_sdk(client, reference_llm):
    """What agent loops send: explicit None for optional fields (JSON null), and the last
    answer appended as `message.model_dump()` (refusal, annotations, audio: null / [])."""
    first = [{"role": "user", "content": "Name a color."}]
    answer = client.chat.completions.create(
        model=MODEL, messages=first, temperature=0, max_tokens=8, n=None, stream=None,
        logprobs=None, top_logprobs=None, seed=None, store=None, metadata=None,
        service_tier=None, reasoning_effort=None)
    assert answer.choices[0].message.content == ref_chat(
        reference_llm, first, temperature=0, max_tokens=8).outputs[0].text
    replayed = answer.choices[0].message.model_dump()
    assert "refusal" in replayed and "annotations" in replayed
    history = [*first, replayed, {"role": "user", "content": "Another one."}]
    again = client.chat.completions.create(model=MODEL, messages=history, temperature=0,
                                           max_tokens=8)
    ref = ref_chat(reference_llm, [*first, {"role": "assistant",
                                            "content": replayed["content"]},
                                   history[-1]], temperature=0, max_tokens=8)
    assert again.choices[0].message.content == ref.outputs[0].text
