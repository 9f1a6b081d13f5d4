"""Gemma 2 and Gemma 3 (text) against transformers (tiny random checkpoints, float32): soft-
capped attention and logits, (1 + w) norms, four norms a layer, the scaled embedding,
q/k norms, local layers with their own rope base and a window shorter than the prompts
(so chunked prefill straddles the window edge), head_dim 256, linear rope on global layers."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.engine.models.config import ModelConfig
from baton.engine.models.gemma import Gemma3ForCausalLM, local_rope_config
from tests.unit.engine.models.parity import check_parity, check_preemption, prompts_for, save_tiny

COMMON = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=24)

GEMMA2 = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
              final_logit_softcapping=15.0)

CASES = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, GEMMA2),
    # q/k norms, local rope base 10k vs global 1M with linear scaling, 5:1 local/global
    # pattern cut short (layers 0-2 local, 3 global)
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=16, query_pre_attn_scalar=16,
                    layer_types=["sliding_attention"] * 3 + ["full_attention"],
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                           "rope_theta": 1_000_000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # Gemma 3's real head size (256, wider than hidden), MHA, global layer first
    "gemma3-hd256": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                     dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=256, query_pre_attn_scalar=256,
                          layer_types=["full_attention", "sliding_attention",
                                       "sliding_attention"])),
}


def _init(model):
    """Non-zero norm weights (Gemma's (1 + w) starts at w = 0), so a norm that forgot the
    offset or was left out shows."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.normal_(0.0, 0.5)


def _tiny(case, path, model_dir):
    config_cls, model_cls, extra = CASES[case]
    return save_tiny(config_cls(**COMMON, **extra), model_cls, path, model_dir, init=_init)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case, tmp_path, model_dir):
    hf = _tiny(case, tmp_path, model_dir)
    # Prompts of 37-150 tokens over a 24-token window; 32-token chunks cross its edge.
    llm = check_parity(tmp_path, hf, max_tokens=12)
    # Global layers read every block: nothing may be released out of the local window.
    assert llm.engine.kv.sliding_window is None


def test_preemption_keeps_parity(tmp_path, model_dir):
    hf = _tiny("gemma2", tmp_path, model_dir)
    check_preemption(tmp_path, hf, prompts_for(1001, (40, 60, 70, 50)))


@pytest.mark.parametrize("arch, extra, globals_", [
    ("Gemma2ForCausalLM", {}, [1, 3, 5]),
    ("Gemma3ForCausalLM", {}, [5]),
    ("Gemma3ForCausalLM", {"sliding_window_pattern": 3}, [2, 5]),
])
def test_configs_without_layer_types_alternate(arch, extra, globals_):
    """Hub configs written before `layer_types` existed: every k-th layer global (k = 2
    for Gemma 2, `sliding_window_pattern` or 6 for Gemma 3), never all sliding."""
    cfg = ModelConfig.from_dict(dict(architectures=[arch], vocab_size=10, hidden_size=8,
                                     num_hidden_layers=6, num_attention_heads=1,
                                     sliding_window=4096, **extra))
    assert [i for i in range(6) if cfg.window_of(i) is None] == globals_
    assert not cfg.all_sliding


def test_local_rope_reads_old_and_new_configs():
    base = dict(architectures=["Gemma3ForCausalLM"], vocab_size=10, hidden_size=8,
                num_hidden_layers=2, num_attention_heads=1, head_dim=8, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"])
    old = ModelConfig.from_dict({**base, "rope_theta": 1e6, "rope_local_base_freq": 5e4,
                                 "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (old.rope_theta, dict(old.rope_scaling)["factor"]) == (1e6, 8.0)
    assert (local_rope_config(old).rope_theta, local_rope_config(old).rope_scaling) == (5e4, None)
    new = ModelConfig.from_dict({**base, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 2e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3e4}}})
    assert (new.rope_theta, new.rope_scaling) == (2e6, None)
    local = local_rope_config(new)
    assert (local.rope_theta, dict(local.rope_scaling)["factor"]) == (3e4, 2.0)


def test_multimodal_checkpoint_names_map_to_the_text_model():
    cfg = ModelConfig.from_dict(dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=1, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention"]))  # no tie_word_embeddings: Gemma ties
    with torch.device("meta"):
        model = Gemma3ForCausalLM(cfg, 16)
    params = dict(model.named_parameters())
    t = torch.zeros(1)
    for name, ours in [("model.language_model.layers.0.self_attn.q_norm.weight",
                        "layers.0.attn.q_norm.weight"),
                       ("language_model.model.embed_tokens.weight", "embed_tokens.weight"),
                       ("model.language_model.norm.weight", "norm.weight")]:
        [(pname, _, _)] = model.checkpoint_weights(name, t)
        assert pname == ours and pname in params
    assert not list(model.checkpoint_weights("model.vision_tower.encoder.x.weight", t))
    assert model.lm_head is None
    assert not list(model.checkpoint_weights("lm_head.weight", t))  # tied


def test_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path, model_dir):
    """Gemma 3 4B/12B/27B ship as Gemma3ForConditionalGeneration: their language model loads
    (vision tower skipped) and generates what transformers' text path generates."""
    text = transformers.Gemma3TextConfig(**COMMON, **CASES["gemma3"][2])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4)
    hf = save_tiny(config, transformers.Gemma3ForConditionalGeneration, tmp_path, model_dir,
                   init=_init)
    assert ModelConfig.from_dir(tmp_path).architecture == "Gemma3ForConditionalGeneration"
    prompts = prompts_for(1001, (5, 40))
    check_parity(tmp_path, hf, prompts, max_tokens=6)
