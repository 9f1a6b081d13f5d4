"""LoRA over the base linears the CPU platform really runs: bf16 packed linears with the
one-call decode step on (steps with adapter rows must leave it for the layer-by-layer path;
base-only steps keep it, bit for bit the engine without LoRA), and the bundled model's
GGUF-quantized linears (`--quantization auto`)."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.attention import ForwardContext
from baton.engine.lora.layer import LoRALinear
from baton.engine.runner.batch import build_batch
from baton_cpu.quant_linear import QuantLinear
from benchmarks.lora_adapters import write_random_adapter
from tests.conftest import make_text
from tests.unit.engine.lora.tiny_lora import save_adapter, tiny_base
from tests.unit.engine.models.parity import prompts_for

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bf16")
    base = tiny_base(root / "base")
    return root, base, save_adapter(base, root / "a", seed=1, r=8)


@torch.inference_mode()
def reference_logprobs(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    """The logprob `hf` (float32) gives each of `tokens` after `prompt` and the ones before."""
    ids = torch.tensor([prompt + tokens])
    logits = hf(ids).logits[0, len(prompt) - 1:-1].float()  # (n, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def run(llm: LLM, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def test_bf16_decode_steps_with_adapter_rows_apply_the_delta(tiny):
    root, base, peft = tiny
    args = dict(skip_tokenizer_init=True, dtype="bfloat16", block_size=16)
    llm = LLM(str(root / "base"), lora_modules=[f"a={root / 'a'}"], **args)
    assert llm.engine.runner.platform.fast_decode is not None, "no one-call step to leave"
    prompts = prompts_for(1000, lengths=(5, 40, 23))
    mixed = run(llm, prompts + prompts, [None] * 3 + ["a"] * 3)
    for i, (tokens, lps) in enumerate(mixed):
        ref = reference_logprobs(base if i < 3 else peft, prompts[i % 3], tokens)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 0.25, (i, lps, ref)
        if i >= 3:  # the base model gives the adapter's tokens other logprobs
            theirs = reference_logprobs(base, prompts[i % 3], tokens)
            assert max(abs(a - b) for a, b in zip(lps, theirs)) > 2.0
    # base-only steps: the same bits as an engine without LoRA (the one-call step)
    plain = LLM(str(root / "base"), **args)
    assert run(llm, prompts, None) == run(plain, prompts, None)


@pytest.mark.parametrize("targets", [["embed_tokens"], ["lm_head", "q_proj"]])
def test_bf16_embedding_and_head_adapters_on_the_one_call_step(tiny, targets):
    """The one-call decode step embeds tokens through the adapters' embedding deltas, and
    the head (packed, bf16) adds its delta through the LoRA kernel."""
    root, base, _ = tiny
    name = "_".join(targets)
    peft = save_adapter(base, root / name, seed=3, r=8, targets=targets)
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, dtype="bfloat16", block_size=16,
              lora_modules=[f"e={root / name}"])
    assert llm.engine.runner.lora.fast_path_ready
    prompts = prompts_for(1000, lengths=(5, 40, 23))
    for prompt, (tokens, lps) in zip(prompts, run(llm, prompts, ["e"] * 3)):
        ref = reference_logprobs(peft, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(lps, ref)) < 0.25, (lps, ref)
        theirs = reference_logprobs(base, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(lps, theirs)) > 2.0


@pytest.mark.parametrize("loras", [("a", None, "b", "a"), ("b", None, "b", None)])
def test_one_call_step_applies_the_adapters_as_the_python_path(tiny, loras):
    """A decode step of adapter and base rows through the one-call step (the LoRA kernel
    after each linear its step's adapters adapt) equals the layer-by-layer path bit for bit,
    KV cache included; with adapter b alone (q_proj, down_proj) the step skips o and
    gate_up."""
    root, base, _ = tiny
    save_adapter(base, root / "b", seed=2, r=4, targets=["q_proj", "down_proj"])
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, dtype="bfloat16", block_size=16,
              max_loras=2, lora_modules=[f"a={root / 'a'}", f"b={root / 'b'}"])
    engine, runner = llm.engine, llm.engine.runner
    assert runner.lora.fast_path_ready
    registry = runner.lora.registry
    for i, (n, lora) in enumerate(zip((5, 17, 40, 9), loras)):
        engine.add(engine.make_request(f"r{i}", [(37 * i + 11 * j) % 900 + 10 for j in range(n)],
                                       SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True),
                                       lora=None if lora is None else registry.get(lora)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in
              list(engine.scheduler.running) + list(engine.scheduler.waiting)):
        engine.step()
    sched = engine.scheduler.schedule()
    batch = build_batch(sched.scheduled, engine.kv.get_block_ids, runner.block_size,
                        runner.device)
    assert runner.platform.fast_decode.can_run(batch) and runner.lora.begin_step(batch)
    try:
        before = runner.kv_cache.clone()
        native = runner.platform.fast_decode.run(batch)
        native_cache, _ = runner.kv_cache.clone(), runner.kv_cache.copy_(before)
        ctx = ForwardContext(runner.backend, runner.backend.build_metadata(batch.layout),
                             runner.kv_caches)
        with torch.inference_mode():
            python = runner.model(batch.input_ids, batch.positions, ctx)
        base_rows = runner.lora.state.row_slots < 0
    finally:
        runner.lora.end_step()
    assert torch.equal(native, python) and torch.equal(native_cache, runner.kv_cache)
    assert 0 < int(base_rows.sum()) < len(base_rows)
    used = [p is not None for p in runner.platform.fast_decode.step._lora_linears]
    assert used == [True] * len(used) if "a" in loras else [True, False, False, True] * 2


@pytest.fixture(scope="module")
def bundled_adapter(model_dir, tmp_path_factory):
    return write_random_adapter(model_dir, tmp_path_factory.mktemp("lora_q") / "a", seed=7,
                                r=16, std=0.05)


@pytest.mark.slow
def test_quantized_linears_take_the_delta(bundled_adapter):
    """Prefill chunks of >= 16 rows run a QuantLinear as the bf16 GEMM of its de-quantized
    weight, so an adapter's prompt logprobs over the quantized model are the de-quantized
    model's (`--quantization none`) with the same adapter, but for the quantized head."""
    args = dict(dtype="bfloat16", block_size=16, num_kv_blocks=64,
                lora_modules=[f"a={bundled_adapter}"])
    quantized, dequantized = LLM(quantization="auto", **args), LLM(quantization="none", **args)
    layer = quantized.engine.runner.model.layers[0].attn.qkv_proj
    assert isinstance(layer, LoRALinear) and isinstance(layer.base, QuantLinear)
    prompt = quantized.get_tokenizer().encode(make_text(1, 3))[:48]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def prompt_lps(llm, lora):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        return torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])

    q, d = prompt_lps(quantized, "a"), prompt_lps(dequantized, "a")
    # the head stays int8-quantized (Q8_0) at every batch: its noise is the difference,
    # as for the base model (measured: mean 0.02-0.04, max 0.17 nats either way); the
    # adapter moves the logprobs by 0.8 nats on average
    assert (q - d).abs().mean() < 0.1 and (q - d).abs().max() < 0.5, (q - d).abs().max()
    assert (q - prompt_lps(quantized, None)).abs().mean() > 0.3  # the adapter matters
