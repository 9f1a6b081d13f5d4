"""The engine on the device: CUDA-graph decode replays equal eager runs, greedy tokens equal
Hugging Face transformers' `generate` (the bundled model and an 8B-shaped random model), and
a sampled request (seeded, temperature 1) completes."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.conftest import parity_prompts
from tests.gpu.models import LLAMA3_8B_2L, TINY, prompt_ids, save_random_llama

MAX_NEW = 24
# Each engine's share of the GPU: a failed test's engine may live on in its traceback, and the
# next test's must still fit beside it.
SHARE = {"gpu_memory_utilization": 0.3}


def greedy(max_tokens: int = MAX_NEW, ignore_eos: bool = False) -> SamplingParams:
    # Without ignore_eos, as Hugging Face's generate: both stop after an EOS.
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def engine_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0  # every block back in the pool
    return [o.outputs[0].token_ids for o in outs]


def hf_tokens(model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                 do_sample=False)
            refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_llama(path, model_dir, TINY, torch.device("cuda"))
    torch.cuda.empty_cache()
    return str(path)


def test_cuda_graph_replays_equal_eager(tiny_model):
    # No prefix caching: the second run must prefill exactly as the first.
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", attention_backend="triton", **SHARE,
              block_size=16, max_num_seqs=8, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and runner.kv_cache.is_cuda
    graphs = runner.platform.fast_decode
    assert graphs is not None, "no CUDA graphs captured on the device"
    prompts = prompt_ids(5, TINY["vocab_size"], seed=4)
    replayed = engine_tokens(llm, prompts, greedy(40, ignore_eos=True))
    assert sum(graphs.replays.values()) > 0, "decode steps did not replay graphs"

    eager_graphs = runner.platform.fast_decode = runner.make_decode_graphs(use_graphs=False)
    eager_graphs.capture()
    eager = engine_tokens(llm, prompts, greedy(40, ignore_eos=True))
    assert sum(eager_graphs.replays.values()) > 0
    assert replayed == eager


def test_bundled_model_greedy_equals_hf_on_the_device(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer.encode(p) for p in parity_prompts()]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to("cuda")
    expected = hf_tokens(hf.eval(), prompts)
    del hf
    torch.cuda.empty_cache()
    llm = LLM(str(model_dir), device="cuda", dtype="float32", block_size=16, **SHARE)
    assert llm.engine.runner.device.type == "cuda"
    assert engine_tokens(llm, prompts, greedy()) == expected


def test_8b_shaped_random_model_greedy_equals_hf(tmp_path, model_dir):
    hf = save_random_llama(tmp_path, model_dir, LLAMA3_8B_2L, torch.device("cuda"))
    prompts = prompt_ids(6, LLAMA3_8B_2L["vocab_size"], seed=5)
    expected = hf_tokens(hf, prompts, 16)
    del hf
    torch.cuda.empty_cache()
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16, max_model_len=1024,
              **SHARE)
    assert llm.engine.runner.backend.name == "triton"
    assert engine_tokens(llm, prompts, greedy(16)) == expected


def test_a_seeded_sampled_request_completes_on_the_device(tiny_model):
    llm = LLM(tiny_model, device="cuda", dtype="bfloat16", **SHARE)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    prompts = prompt_ids(3, TINY["vocab_size"], seed=6)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again):
        assert len(a.outputs[0].token_ids) == 32
        assert a.outputs[0].finish_reason == "length"
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # the seed is honoured
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0


def test_async_scheduling_launches_ahead_and_gives_the_synchronous_outputs(tiny_model):
    """Steps launched ahead of the host (`runner/ahead.py`): the pending inputs come from
    the last step's token tensor on the device; greedy, seeded and stopped requests end as
    in the synchronous engine, every block back; penalised ones too, their pending token
    read on the device (`engine/penalty_ids.py`). `auto` (None) schedules ahead on CUDA."""
    prompts = prompt_ids(8, TINY["vocab_size"], seed=8)
    params = [greedy(24), SamplingParams(temperature=1.0, seed=7, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[5, 9, 17]),
              SamplingParams(temperature=0, max_tokens=24, presence_penalty=2.0,
                             frequency_penalty=1.0, repetition_penalty=1.5)] * 2
    got = {}
    for mode in (False, None):
        llm = LLM(tiny_model, device="cuda", dtype="float32", async_scheduling=mode, **SHARE)
        assert llm.engine.async_scheduling is (mode is None) and llm.engine.runner.launches_async
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        llm.engine.check_integrity()
        assert llm.engine.kv.num_used_blocks == 0
        assert llm.engine.timing.device_s > 0
        del llm
        torch.cuda.empty_cache()
    assert got[None] == got[False]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="tensor parallelism needs 2 GPUs")  # no CUDA: conftest's reason
def test_tp2_launches_ahead_and_gives_the_synchronous_outputs(tiny_model):
    """Two ranks over NCCL, steps launched ahead: rank 0 broadcasts each step's pending
    tokens to the follower on the device (`ahead.fill_pending`); outputs equal the
    synchronous engine's, every step read."""
    prompts = prompt_ids(6, TINY["vocab_size"], seed=9)
    params = [greedy(24), SamplingParams(temperature=1.0, seed=7, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5)] * 2
    got = {}
    for mode in (False, True):
        llm = LLM(tiny_model, device="cuda", dtype="float32", async_scheduling=mode,
                  tensor_parallel_size=2, **SHARE)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[mode] = [o.outputs[0].token_ids for o in outs]
            assert not llm.engine.runner.tp_leader._unread
        finally:
            llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    assert got[True] == got[False]
