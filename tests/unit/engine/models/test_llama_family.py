"""Llama, Mistral and Qwen2 against transformers (tiny random checkpoints, float32): odd
shapes (head_dim 80 / 96, GQA 1 / 4, a vocabulary not a multiple of 64, tied and untied
embeddings) and the RoPE scalings Llama uses."""

from __future__ import annotations

import pytest
import transformers

from baton import LLM, SamplingParams
from tests.unit.engine.models.parity import (
    check_parity,
    check_preemption,
    hf_greedy,
    prompts_for,
    save_tiny,
)

COMMON = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2)

CASES = {
    # GQA 4, head_dim 80 (q/k/v of another width than the hidden size), untied
    "llama-gqa4-hd80": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=80,
                             tie_word_embeddings=False)),
    # MHA (GQA 1), tied embeddings, linear RoPE scaling (Llama 2 long-context fine-tunes)
    "llama2-linear-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                           dict(num_attention_heads=4, num_key_value_heads=4,
                                tie_word_embeddings=True,
                                rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 10000.0})),
    # Llama 3.1 scaling, head_dim 96
    "llama31-hd96": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     dict(num_attention_heads=2, num_key_value_heads=1, head_dim=96,
                          tie_word_embeddings=False,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                           "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64})),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # Qwen2.5's long-context YaRN (factor 4 over an original 128 positions the prompts pass)
    "qwen2-yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 128,
                                         "rope_theta": 1000000.0})),
    # dynamic NTK, context within max_position_embeddings (the engine's own window is twice
    # that: the table's rows past it are scaled)
    "llama-dynamic": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      dict(num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False,
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                            "rope_theta": 10000.0})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case, tmp_path, model_dir):
    config_cls, model_cls, extra = CASES[case]
    config = config_cls(**COMMON, **extra)

    def init(model):
        for layer in model.model.layers:
            attn = layer.self_attn
            if getattr(attn.q_proj, "bias", None) is not None:
                attn.q_proj.bias.normal_()
                attn.k_proj.bias.normal_()

    hf = save_tiny(config, model_cls, tmp_path, model_dir, init=init)
    check_parity(tmp_path, hf)


def test_preemption_keeps_parity(tmp_path, model_dir):
    config_cls, model_cls, extra = CASES["llama-gqa4-hd80"]
    hf = save_tiny(config_cls(**COMMON, **extra), model_cls, tmp_path, model_dir)
    check_preemption(tmp_path, hf, prompts_for(1001, (40, 60, 70, 50)))


def test_dynamic_ntk_past_max_positions_decodes_as_hf_generate(tmp_path, model_dir):
    """Decoding past max_position_embeddings: each new position rotated with the
    frequencies Hugging Face's generate computes for it (rope.py's per-position rows)."""
    extra = dict(CASES["llama-dynamic"][2], max_position_embeddings=96)
    hf = save_tiny(transformers.LlamaConfig(**COMMON | extra), transformers.LlamaForCausalLM,
                   tmp_path, model_dir)
    prompts = prompts_for(1001, (60, 90))
    refs = hf_greedy(hf, prompts, max_tokens=40)  # positions up to 129 > 96
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == 192
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
