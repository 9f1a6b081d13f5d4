"""Quantized checkpoints served on the device (`--quantization auto`): every linear of a
GPTQ, AWQ, compressed-tensors int8 or FP8-block checkpoint becomes a GPUQuantLinear, and the
served logprobs stay within the format's tolerance of the de-quantized weights'
(`--quantization none`)."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.engine.quant.gpu_linear import GPUQuantLinear
from tests.unit.engine.quant import quant_checkpoints as qc

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 300, 42], list(range(10, 60))]
KW = dict(device="cuda", dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=64,
          enforce_eager=True)
CASES = {"gptq": lambda p: qc.save_gptq(p, 4, 32), "awq": lambda p: qc.save_awq(p, 32),
         "fp8-blocks": lambda p: qc.save_fp8_blocks(p, 64)}


def first_logprobs(llm):
    from tests.unit.engine.quant.test_quantized_checkpoints import greedy

    return [(tokens[0], logprobs[0]) for tokens, logprobs in greedy(llm, PROMPTS, GREEDY)]


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_linears_serve_on_the_device(tmp_path, name):
    _, path = CASES[name](tmp_path / name)
    plain = first_logprobs(LLM(str(path), quantization="none", **KW))
    llm = LLM(str(path), quantization="auto", **KW)
    assert sum(isinstance(m, GPUQuantLinear) for m in llm.engine.runner.model.modules()) == 8
    for (token, logprob), (ref_token, ref_logprob) in zip(first_logprobs(llm), plain):
        assert token == ref_token and abs(logprob - ref_logprob) < 0.15
