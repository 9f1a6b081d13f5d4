"""Greedy tokens from the engine equal Hugging Face transformers' `generate` on the bundled
model (float32), whatever the chunk size, block size, prefix-cache state or preemption."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.conftest import parity_prompts

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer.encode(p) for p in parity_prompts()]
    assert len(ids) >= 16 and sum(len(i) > 600 for i in ids) >= 3
    return ids


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompt_ids):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            refs.append(out[0, len(ids):].tolist())
    return refs


def run(prompt_ids, **engine_args):
    llm = LLM(dtype="float32", **engine_args)
    outs = llm.generate([list(p) for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0
    return llm, [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("block_size,budget", [(16, 4096), (32, 64), (16, 7), (32, 300)])
def test_matches_hf_for_chunk_and_block_sizes(prompt_ids, hf_tokens, block_size, budget):
    _, tokens, _ = run(prompt_ids, block_size=block_size, max_num_batched_tokens=budget)
    assert tokens == hf_tokens


def test_matches_hf_with_prefix_cache_hits(prompt_ids, hf_tokens):
    llm, first, outs = run(prompt_ids, block_size=16, max_num_batched_tokens=512)
    # Prompts sharing the long prefix hit blocks cached by the first of them.
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 3
    second = llm.generate([list(p) for p in prompt_ids],
                          SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 16)
    assert first == hf_tokens
    assert [o.outputs[0].token_ids for o in second] == hf_tokens


def test_matches_hf_under_preemption(prompt_ids, hf_tokens):
    # 62 blocks hold the longest prompt (867 tokens + 24 outputs = 56 blocks) but not it
    # and its neighbours as they grow: the schedule is deterministic and preempts.
    llm, tokens, _ = run(prompt_ids, block_size=16, num_kv_blocks=62, enable_prefix_caching=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens == hf_tokens


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_batching_baselines_match_hf(prompt_ids, hf_tokens, policy):
    _, tokens, _ = run(prompt_ids, block_size=32, scheduling_policy=policy, max_num_seqs=5,
                       batch_window_ms=20)
    assert tokens == hf_tokens


def test_async_scheduling_matches_hf_under_preemption_and_chunking(prompt_ids, hf_tokens):
    llm, tokens, _ = run(prompt_ids, block_size=16, num_kv_blocks=62, max_num_batched_tokens=300,
                         async_scheduling=True)
    assert llm.engine.async_scheduling and llm.engine.scheduler.num_preemptions > 0
    assert tokens == hf_tokens
