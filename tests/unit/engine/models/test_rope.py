"""RoPE frequencies and tables against transformers' rope init functions and rotary modules,
for every scaling type, including the per-position semantics of dynamic and longrope."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

from baton.engine.models.config import ModelConfig
from baton.engine.models.rope import (
    RotaryEmbedding,
    apply_rotary,
    attention_factor,
    context_limit,
    inverse_frequencies,
    partial_rotary_order,
    rotary_dim,
)

SIZES = dict(vocab_size=100, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

LLAMA_SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 1000000.0},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0,
                         "beta_slow": 2.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": 128, "rope_theta": 10000.0},
}


def phi3_longrope(partial: float = 1.0, attention: float | None = None):
    pairs = int(SIZES["hidden_size"] // SIZES["num_attention_heads"] * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [2.0 + 0.5 * i for i in range(pairs)]}
    if attention is not None:
        rope["attention_factor"] = attention
    sizes = SIZES | dict(max_position_embeddings=1024)
    return transformers.Phi3Config(**sizes, original_max_position_embeddings=128,
                                   rope_parameters=rope, partial_rotary_factor=partial)


def ours(hf_config, arch: str) -> ModelConfig:
    return ModelConfig.from_dict(hf_config.to_dict() | {"architectures": [arch]})


def llama(case: str):
    return transformers.LlamaConfig(**SIZES, rope_parameters=dict(LLAMA_SCALINGS[case]))


@pytest.mark.parametrize("case", sorted(LLAMA_SCALINGS))
def test_llama_scalings_match_init_functions(case):
    hf = llama(case)
    cfg = ours(hf, "LlamaForCausalLM")
    init = ROPE_INIT_FUNCTIONS.get(hf.rope_parameters["rope_type"],
                                   LlamaRotaryEmbedding.compute_default_rope_parameters)
    want, factor = init(hf)
    torch.testing.assert_close(inverse_frequencies(cfg), want, rtol=1e-6, atol=0)
    assert attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    # The tables, positions inside max_position_embeddings: HF's module, one forward.
    positions = torch.arange(SIZES["max_position_embeddings"])[None]
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    table = RotaryEmbedding(cfg, context_limit(cfg))
    n = positions.shape[1]
    torch.testing.assert_close(table.cos[:n], cos[0], rtol=1e-5, atol=1e-5)
    half = cfg.head_dim // 2
    torch.testing.assert_close(table.signed_sin[:n, half:], sin[0, :, half:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(table.signed_sin[:n, :half], -sin[0, :, :half], rtol=1e-5, atol=1e-5)


def test_dynamic_beyond_max_positions_is_what_hf_decodes_there():
    hf = llama("dynamic")
    cfg = ours(hf, "LlamaForCausalLM")
    mpe = SIZES["max_position_embeddings"]
    assert context_limit(cfg) == 3 * mpe
    table = RotaryEmbedding(cfg, context_limit(cfg))
    module = LlamaRotaryEmbedding(hf)
    for p in (mpe, mpe + 1, mpe + 57, 3 * mpe - 1):  # HF's decode steps, growing
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, seq_len=torch.tensor(p + 1))
        torch.testing.assert_close(inverse_frequencies(cfg, seq_len=p + 1), want, rtol=1e-6,
                                   atol=0)
        cos, _ = module(torch.zeros(1), torch.tensor([[p]]))
        torch.testing.assert_close(table.cos[p], cos[0, 0], rtol=1e-5, atol=1e-5)
    # and the scaled rows really differ from the unscaled ones
    plain = RotaryEmbedding(dataclasses.replace(cfg, rope_scaling=None), 3 * mpe)
    assert torch.equal(table.cos[:mpe], plain.cos[:mpe])
    assert not torch.allclose(table.cos[mpe + 10:], plain.cos[mpe + 10:])


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("attention", [None, 1.3])
def test_longrope_short_and_long_factors(partial, attention):
    hf = phi3_longrope(partial, attention)
    cfg = ours(hf, "Phi3ForCausalLM")
    orig, full = 128, 1024
    assert rotary_dim(cfg) == int(cfg.head_dim * partial)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=orig + 1)
    torch.testing.assert_close(inverse_frequencies(cfg), short, rtol=1e-6, atol=0)
    torch.testing.assert_close(inverse_frequencies(cfg, seq_len=orig + 1), long, rtol=1e-6,
                               atol=0)
    assert attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    assert factor == pytest.approx(attention or math.sqrt(1 + math.log(8) / math.log(128)))
    table = RotaryEmbedding(cfg, context_limit(cfg))
    assert context_limit(cfg) == full
    r = rotary_dim(cfg)
    module = Phi3RotaryEmbedding(hf)
    # Within the original length HF uses the short factors; past it, a forward reaching
    # position p >= orig uses the long ones: our rows from orig on.
    for positions, rows in ((torch.arange(orig), slice(0, orig)),
                            (torch.arange(full), slice(orig, full))):
        cos, sin = module(torch.zeros(1), positions[None])  # (1, P, r)
        ours_cos = torch.cat((table.cos[:, :r // 2], table.cos[:, cfg.head_dim // 2:][:, :r // 2]), -1)
        torch.testing.assert_close(ours_cos[rows], cos[0, rows], rtol=1e-5, atol=1e-5)


def test_partial_rotary_order_rotates_as_hf_does():
    hf = phi3_longrope(0.75)
    cfg = ours(hf, "Phi3ForCausalLM")
    D, r = cfg.head_dim, rotary_dim(cfg)
    order = partial_rotary_order(D, r)
    assert sorted(order.tolist()) == list(range(D))
    positions = torch.tensor([0, 5, 127])
    x = torch.randn(3, 2, D)  # (T, heads, D)
    cos, sin = Phi3RotaryEmbedding(hf)(x, positions[None])  # (1, T, r)
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None],
                                   cos, sin)  # (1, heads, T, D)
    table = RotaryEmbedding(cfg, 256)
    got = apply_rotary(x[..., order], *table.lookup(positions, torch.float32))
    torch.testing.assert_close(got, want[0].transpose(0, 1)[..., order], rtol=1e-5, atol=1e-5)
    assert not torch.equal(order, torch.arange(D))
    assert torch.equal(partial_rotary_order(D, D), torch.arange(D))


def test_yarn_extends_the_context_and_others_do_not():
    assert context_limit(ours(llama("yarn"), "LlamaForCausalLM")) == 256  # 64 * 4
    cfg = ours(transformers.Qwen2Config(**SIZES | dict(max_position_embeddings=32),
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                         "rope_theta": 1e6,
                                                         "original_max_position_embeddings": 32}),
               "Qwen2ForCausalLM")
    assert context_limit(cfg) == 128
    for case in ("default", "linear", "llama3"):
        assert context_limit(ours(llama(case), "LlamaForCausalLM")) == 256


def test_unsupported_types_are_refused_by_name():
    cfg = ours(llama("default"), "LlamaForCausalLM")
    odd = dataclasses.replace(cfg, rope_scaling=(("factor", 2.0), ("rope_type", "mrope")))
    with pytest.raises(ValueError, match="'mrope'.*default, linear, dynamic, llama3, yarn, longrope"):
        RotaryEmbedding(odd, 16)
    legacy = dataclasses.replace(cfg, rope_scaling=(("type", "linear"), ("factor", 2.0)))
    torch.testing.assert_close(inverse_frequencies(legacy), inverse_frequencies(cfg) / 2)


def test_odd_partial_rotary_is_refused():
    cfg = ours(llama("default"), "LlamaForCausalLM")
    odd = dataclasses.replace(cfg, hf={**cfg.hf, "partial_rotary_factor": 0.3})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.3"):
        rotary_dim(odd)
