"""Deterministic mode (`deterministic=True`, `platforms/cpu.py`): in bf16 on the bundled model,
a request's greedy tokens and logprobs are the same alone or in a mixed batch, and a stream
resumed from any point (its prompt plus the tokens already sent, prefilled in chunks) goes
on with exactly the tokens the undisturbed run made in decode steps — the bf16 resume
divergence of issue 38. The modes and places it cannot serve are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.platforms import make_platform
from tests.conftest import QUESTIONS, make_text

PROMPTS = [make_text(3, 1) + "\nWrite a long story about it.", "def fibonacci(n):",
           make_text(2, 4) + "\n\n" + QUESTIONS[1], make_text(6, 2) + "\nQuestion: why?"]
STEPS = 48


@pytest.fixture(scope="module")
def llm(kernel_cache):
    # 64-token chunks: a resumed prompt is prefilled in pieces the decode steps never made
    return LLM(dtype="bfloat16", deterministic=True, num_kv_blocks=512,
               max_num_batched_tokens=64, cache_dir=str(kernel_cache))


def _greedy(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate(p, _greedy(), use_tqdm=False)[0] for p in PROMPTS]


def _logprobs(out) -> list[float]:
    return [lp.logprob for lp in out.outputs[0].logprobs]


def test_a_request_decodes_the_same_alone_or_in_a_batch(llm, alone):
    batch = llm.generate(PROMPTS * 2, _greedy(), use_tqdm=False)
    for a, b in zip(alone * 2, batch):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert _logprobs(b) == _logprobs(a)


@pytest.mark.parametrize("sent", [1, 7, 30])
def test_a_resumed_stream_goes_on_exactly(llm, alone, sent):
    resumed = llm.generate(
        [{"prompt_token_ids": list(a.prompt_token_ids) + list(a.outputs[0].token_ids[:sent])}
         for a in alone], _greedy(STEPS - sent), use_tqdm=False)
    for a, r in zip(alone, resumed):
        assert list(r.outputs[0].token_ids) == list(a.outputs[0].token_ids[sent:])
        assert _logprobs(r) == _logprobs(a)[sent:]


def test_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_args(deterministic=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="CPU only"):
        make_platform(torch.device("cuda"), cache_dir=None, deterministic=True)
