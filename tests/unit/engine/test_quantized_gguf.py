"""`--quantization auto` on the bundled model (`platforms/cpu_quant.py`): its Q4_1 linears and
Q8_0 head served from the GGUF's own blocks, through the one-call decode step, against the
same model de-quantized to bf16 (`--quantization none`): sensible greedy text, and each
prompt position's logits close. The same for the bundled weights re-quantized as llama.cpp's
Q4_K_M mix (`benchmarks/gguf_variants.py`: ffn_down in Q4_K or Q6_K, some layers' qkv a
Q4_1 + Q8_0 pair of parts).

Why the tolerance: both models hold the file's weights (the de-quantized one rounded to
bf16, 2^-9 relative per weight); the quantized one rounds its activations to int8 per
32-element block (~1/254 of the block's largest value per element). Neither is the other's
reference, so the test bounds their distance: top-1 tokens agree on at least 90% of the
positions, and where they differ the two tokens were near-ties (within 1 nat) for the bf16
model; the log-probabilities of the text's own tokens differ by at most 0.15 nats on average.
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.models.loader import default_cache_dir
from baton_cpu.linear import PackedLinear
from baton_cpu.quant_linear import QuantLinear
from benchmarks.gguf_variants import more_bits, requantized_gguf
from tests.conftest import make_text

ARGS = dict(dtype="bfloat16", block_size=16, num_kv_blocks=128, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def quantized():
    return LLM(quantization="auto", **ARGS)


@pytest.fixture(scope="module")
def dequantized():
    return LLM(quantization="none", **ARGS)


@pytest.fixture(scope="module")
def q4_k_m():
    return str(requantized_gguf("Q4_K_M", default_cache_dir()))


@pytest.fixture(scope="module")
def k_quantized(q4_k_m):
    return LLM(q4_k_m, quantization="auto", **ARGS)


@pytest.fixture(scope="module")
def k_dequantized(q4_k_m):
    return LLM(q4_k_m, quantization="none", **ARGS)


def test_auto_serves_the_files_blocks_through_the_one_call_step(quantized, dequantized):
    model = quantized.engine.runner.model
    for layer in model.layers:
        linears = (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        assert [type(m) for m in linears] == [QuantLinear] * 4
        assert {m.qtype.name for m in linears} == {"Q4_1"}
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.qtype.name == "Q8_0"
    assert model.layers[0].attn.qkv_proj.out_features == (9 + 2 * 3) * 64
    assert isinstance(dequantized.engine.runner.model.layers[0].attn.o_proj, PackedLinear)
    if dequantized.engine.runner.platform.fast_decode is not None:  # a C compiler here
        assert quantized.engine.runner.platform.fast_decode is not None


def test_greedy_text_is_sensible(quantized):
    # Completion prompts whose answer is not a near-tie for this small model (its chat answer
    # to the same question opens with "The" or "L'" within 0.13 nats, and so differs).
    out = quantized.generate(["The capital of France is", "def fibonacci(n):"],
                             SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert "return" in out[1].outputs[0].text


def test_q4_k_m_serves_k_types_and_mixed_parts(k_quantized):
    model = k_quantized.engine.runner.model
    n = len(model.layers)
    for i, layer in enumerate(model.layers):
        wide = "Q6_K" if more_bits(i, n) else "Q4_K"
        assert layer.mlp.down_proj.type_names == wide
        assert layer.attn.qkv_proj.type_names == ("Q4_1+Q8_0" if more_bits(i, n) else "Q4_1")
        assert layer.mlp.gate_up_proj.type_names == "Q4_1"
    out = k_quantized.generate(["The capital of France is"],
                               SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize("pair", [("quantized", "dequantized"),
                                  ("k_quantized", "k_dequantized")])
def test_logits_close_to_the_dequantized_model(request, pair):
    quantized, dequantized = map(request.getfixturevalue, pair)
    tok = quantized.get_tokenizer()
    prompts = [tok.encode(make_text(2, i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)
    agree, positions, drift = 0, 0, 0.0
    for prompt in prompts:
        (q,), (d,) = (llm.generate([prompt], params, use_tqdm=False)
                      for llm in (quantized, dequantized))
        for lq, ld in zip(q.prompt_logprobs[1:], d.prompt_logprobs[1:], strict=True):
            positions += 1
            drift += abs(lq.logprob - ld.logprob)
            if lq.top[0][0] == ld.top[0][0]:
                agree += 1
                continue
            theirs = dict(ld.top)
            assert lq.top[0][0] in theirs  # a near-tie for the bf16 model
            assert ld.top[0][1] - theirs[lq.top[0][0]] < 1.0
    assert agree >= 0.9 * positions, (agree, positions)
    assert drift / positions < 0.15, drift / positions


@pytest.mark.parametrize("engine", ["quantized", "k_quantized"])
def test_one_call_step_equals_the_python_step(request, engine):
    """The fused decode step calls the same quantized kernel as QuantLinear.forward (fused
    linears of parts in different types included)."""
    from tests.unit.engine.test_cpu_platform import _both_paths, _decode_batch, _finish

    quantized = request.getfixturevalue(engine)

    runner = quantized.engine.runner
    if runner.platform.fast_decode is None:
        pytest.skip("the native decode step needs a C compiler")
    sched, batch = _decode_batch(quantized, [5, 17, 40, 9])
    assert runner.platform.fast_decode.can_run(batch)
    (nh, ncache), (ph, pcache), _ = _both_paths(runner, batch)
    assert torch.equal(nh, ph) and torch.equal(ncache, pcache)
    _finish(quantized, sched)
