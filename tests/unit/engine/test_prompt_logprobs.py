"""Prompt logprobs (`prompt_logprobs=k`, completions' echo + logprobs): each prompt token's
logprob given the tokens before it, its rank and the top k, equal to a log_softmax over a
full Hugging Face forward of the prompt, however the prompt is chunked or preempted, and
handed over once, in the request's first output."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.conftest import make_text

pytestmark = pytest.mark.slow
K = 3
TOL = 2e-3  # float32 engine vs float32 transformers, different kernels


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer.encode(make_text(3, i)) for i in range(3)]
    assert all(len(p) > 3 * 32 for p in ids)  # several chunks of 32
    return ids


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """log_softmax of transformers' logits over each whole prompt: (n - 1, V) per prompt,
    row j predicting prompt token j + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].float(), -1)
                for p in prompts]


@pytest.fixture(scope="module")
def llm():
    """Without the prefix cache: these tests repeat prompts (`test_a_cached_prompt_...`
    covers the cache)."""
    return LLM(dtype="float32", max_num_batched_tokens=32, block_size=16, num_kv_blocks=256,
               enable_prefix_caching=False)


def check(prompt_lps, prompt: list[int], ref: torch.Tensor) -> None:
    assert len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    for j, lp in enumerate(prompt_lps[1:]):
        row = ref[j]
        assert lp.token_id == prompt[j + 1]
        assert abs(lp.logprob - float(row[prompt[j + 1]])) < TOL, j
        assert abs(lp.rank - (int((row > row[prompt[j + 1]]).sum()) + 1)) <= 1, j
        vals, ids = row.topk(K)
        assert len(lp.top) == K
        assert [abs(v - float(r)) < TOL for (_, v), r in zip(lp.top, vals)] == [True] * K
        assert lp.top[0][0] == int(ids[0]) or abs(float(vals[0] - vals[1])) < TOL


def test_prompt_logprobs_match_a_full_forward_across_chunks(llm, prompts, reference):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    for out, prompt, ref in zip(outs, prompts, reference):
        check(out.prompt_logprobs, prompt, ref)
    assert llm.engine.kv.num_used_blocks == 0


def test_they_arrive_once_in_the_first_output(llm, prompts):
    core = llm.engine
    core.add(core.make_request("once", list(prompts[0]),
                               SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    with_lps = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_lps) == 1 and with_lps[0] is outs[0] and outs[0].new_token_ids
    assert len(outs[0].prompt_logprobs) == len(prompts[0])
    assert all(lp.top == [] for lp in outs[0].prompt_logprobs[1:])


def test_requests_without_them_get_none(llm, prompts):
    out = llm.generate(list(prompts[0]), SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_n_samples_share_one_computation(llm, prompts, reference):
    params = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=2, prompt_logprobs=K)
    out = llm.generate(list(prompts[1]), params, use_tqdm=False)[0]
    check(out.prompt_logprobs, prompts[1], reference[1])


def test_preemption_neither_loses_nor_repeats_them(prompts, reference):
    small = LLM(dtype="float32", max_num_batched_tokens=32, block_size=16, num_kv_blocks=14,
                max_num_seqs=3)
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=K)
    outs = small.generate([list(p) for p in prompts], params, use_tqdm=False)
    assert small.engine.stats.preemptions_total > 0
    for out, prompt, ref in zip(outs, prompts, reference):
        check(out.prompt_logprobs, prompt, ref)


def test_a_cached_prompt_is_computed_again(prompts, reference):
    cached = LLM(dtype="float32", max_num_batched_tokens=32, block_size=16, num_kv_blocks=64)
    cached.generate(list(prompts[2]), SamplingParams(temperature=0, max_tokens=2),
                    use_tqdm=False)
    out = cached.generate(list(prompts[2]), SamplingParams(temperature=0, max_tokens=2,
                                                           prompt_logprobs=K),
                          use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, prompts[2], reference[2])
