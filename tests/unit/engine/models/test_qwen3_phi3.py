"""Qwen3 and Phi-3 against transformers (tiny random checkpoints, float32): Qwen3's q/k
norms with a head_dim wider than the hidden size and GQA 8; Phi-3's fused checkpoint tensors
with default RoPE and a sliding window, longrope, and Phi-4-mini's partial rotary."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.engine.models.config import ModelConfig
from baton.engine.models.qwen3 import Qwen3ForCausalLM
from tests.unit.engine.models.parity import check_parity, check_preemption, prompts_for, save_tiny

COMMON = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


def longrope(pairs: int, orig: int = 256) -> dict:
    return dict(original_max_position_embeddings=orig,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
                                 "long_factor": [1.5 + 0.4 * i for i in range(pairs)]})


CASES = {
    # GQA 8, head_dim 128 with hidden 64, tied (Qwen3-0.6B's shape, shrunk)
    "qwen3-gqa8-hd128-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                              dict(num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                                   tie_word_embeddings=True)),
    "qwen3-gqa2-hd256-untied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                                dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                     tie_word_embeddings=False)),
    # Phi-3-mini-4k: default RoPE, every layer sliding (a window the prompts exceed)
    "phi3-default-window": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                            dict(num_attention_heads=4, num_key_value_heads=4,
                                 sliding_window=48, tie_word_embeddings=False)),
    # Phi-3-mini-128k: longrope, attention factor from max / original positions (2048 / 256)
    "phi3-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                      dict(num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False,
                           **COMMON | dict(max_position_embeddings=2048), **longrope(8))),
    # Phi-4-mini: partial rotary 0.75 with longrope, GQA, tied
    "phi4mini-partial-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                                  dict(num_attention_heads=2, num_key_value_heads=1,
                                       partial_rotary_factor=0.75, tie_word_embeddings=True,
                                       **longrope(12))),
}


def randomise_norms(model):
    """Qwen3's q/k norm weights away from 1, so that getting them wrong shows."""
    for layer in model.model.layers:
        for norm in (getattr(layer.self_attn, "q_norm", None),
                     getattr(layer.self_attn, "k_norm", None)):
            if norm is not None:
                norm.weight.normal_(1.0, 0.5)


def make_config(case: str):
    config_cls, model_cls, extra = CASES[case]
    return config_cls(**(COMMON | extra)), model_cls


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case, tmp_path, model_dir):
    config, model_cls = make_config(case)
    hf = save_tiny(config, model_cls, tmp_path, model_dir, init=randomise_norms)
    check_parity(tmp_path, hf)


def test_qwen3_preemption_keeps_parity(tmp_path, model_dir):
    config, model_cls = make_config("qwen3-gqa8-hd128-tied")
    hf = save_tiny(config, model_cls, tmp_path, model_dir, init=randomise_norms)
    check_preemption(tmp_path, hf, prompts_for(1001, (40, 60, 70, 50)))


def test_phi3_fused_tensors_fill_every_shard(tmp_path, model_dir):
    """The split checkpoint tensors land where Hugging Face's slices are: q / k / v and
    gate / up of our fused parameters equal the rows of theirs."""
    from baton.engine.models.loader import load_model

    config, model_cls = make_config("phi3-longrope")
    hf = save_tiny(config, model_cls, tmp_path, model_dir)
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), 64)
    ours, theirs = model.layers[1], hf.model.layers[1]
    assert torch.equal(ours.attn.qkv_proj.weight, theirs.self_attn.qkv_proj.weight)
    assert torch.equal(ours.mlp.gate_up_proj.weight, theirs.mlp.gate_up_proj.weight)


def test_qwen3_refuses_attention_bias():
    cfg = transformers.Qwen3Config(**COMMON, num_attention_heads=2, num_key_value_heads=1,
                                   attention_bias=True).to_dict()
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="attention_bias"):
        Qwen3ForCausalLM(ModelConfig.from_dict(cfg), 64)
