"""Tensor parallelism over processes on CPU (gloo): rank 0 in this process, rank 1 a child.

Tiny random Llamas against transformers and against TP=1: 4 heads / 2 kv heads (split) and
4 heads / 1 kv head (replicated on both ranks), through chunked prefill, prefix-cache hits,
logprobs and prompt logprobs."""

from __future__ import annotations

import pytest
import transformers

from baton import LLM, SamplingParams
from tests.unit.engine.models.parity import check_parity, prompts_for, save_tiny

pytestmark = pytest.mark.slow

COMMON = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              num_attention_heads=4, tie_word_embeddings=False)


def tiny_llama(tmp_path, model_dir, kv_heads: int, **extra):
    config = transformers.LlamaConfig(**(COMMON | dict(num_key_value_heads=kv_heads) | extra))
    return save_tiny(config, transformers.LlamaForCausalLM, tmp_path, model_dir)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_tp2_matches_transformers(kv_heads, tmp_path, model_dir):
    hf = tiny_llama(tmp_path, model_dir, kv_heads)
    llm = check_parity(tmp_path, hf, tensor_parallel_size=2, num_threads=1, num_kv_blocks=256)
    try:
        runner = llm.engine.runner
        assert runner.tp.size == 2 and runner.num_kv_heads == 1
        assert runner.kv_cache.shape[-2] == 1  # this rank's kv heads only
    finally:
        llm.engine.close()
    assert runner.tp_leader.procs[0].returncode == 0  # stopped cleanly, not killed


def test_tp2_equals_tp1_with_prompt_logprobs(tmp_path, model_dir):
    tiny_llama(tmp_path, model_dir, 2, tie_word_embeddings=True)
    prompts = prompts_for(1001, (5, 40, 300))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    kwargs = dict(dtype="float32", block_size=16, max_num_batched_tokens=64, num_threads=1,
                  num_kv_blocks=256)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=tp, **kwargs)
        try:
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.close()
    for one, two in zip(outs[1], outs[2]):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert len(two.prompt_logprobs) == len(one.prompt_logprobs)
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_tp2_speculates_exactly(tmp_path, model_dir):
    """n-gram speculation on two ranks: each verify chunk runs on both (the followers see
    the same rows), greedy tokens equal the same engine's without it, and guesses were
    verified."""
    tiny_llama(tmp_path, model_dir, 2)
    loop = [7, 8, 9, 10, 11, 12] * 12  # a prompt whose continuation lookup can guess
    prompts = [{"prompt_token_ids": loop}, {"prompt_token_ids": loop[3:] + [5, 6]}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", tensor_parallel_size=2, num_threads=1, num_kv_blocks=256)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}'
    outs, verified = {}, 0
    for name, extra in (("plain", {}), ("spec", {"speculative_config": spec})):
        llm = LLM(str(tmp_path), **kwargs, **extra)
        try:
            outs[name] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)]
            verified = llm.engine.speculator.counters.verified_requests
        finally:
            llm.engine.close()
    assert outs["spec"] == outs["plain"]
    assert verified > 0


def test_tp2_launched_ahead_gives_the_synchronous_outputs(tmp_path, model_dir, monkeypatch):
    """Async scheduling with each step launched ahead as on CUDA (forced on CPU, where the
    launch runs the step): a step's pending input tokens are on rank 0 only, which
    broadcasts them to the follower for the same rows. A follower that ran without them
    would add wrong partial sums to every all-reduce, so greedy, seeded, penalised and
    logprob outputs equal the synchronous engine's only if they arrive. Every step
    launched is read (the watcher times none afterwards)."""
    import baton.engine.runner.model_runner as model_runner

    tiny_llama(tmp_path, model_dir, 2)
    prompts = prompts_for(1001, (5, 40, 130, 17))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)]
    kwargs = dict(dtype="float32", tensor_parallel_size=2, num_threads=1, num_kv_blocks=256,
                  block_size=16, max_num_batched_tokens=64)
    pending_steps = []
    fill = model_runner.fill_pending
    monkeypatch.setattr(model_runner, "fill_pending", lambda batch, prev, group: (
        pending_steps.append(batch.pending_rows is not None), fill(batch, prev, group))[1])
    outs = {}
    for mode in ("sync", "ahead"):
        llm = LLM(str(tmp_path), async_scheduling=mode == "ahead", **kwargs)
        runner = llm.engine.runner
        runner.launches_async = mode == "ahead"
        try:
            outs[mode] = [
                [(c.token_ids, [(lp.token_id, round(lp.logprob, 3)) for lp in c.logprobs or []])
                 for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
            assert runner.tp_leader._step_since is None and not runner.tp_leader._unread
        finally:
            llm.engine.close()
    assert outs["ahead"] == outs["sync"]
    assert sum(pending_steps) >= 8  # the decodes' inputs came from the step before
