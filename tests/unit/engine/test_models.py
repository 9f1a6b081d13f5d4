"""Our Llama-family module and weight mapping against transformers on tiny random models
(Llama with Llama-3 RoPE scaling, Qwen2 with q/k/v biases, untied heads), greedy, float32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from baton import LLM, SamplingParams


def save_tiny(kind: str, path, model_dir) -> None:
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger weights so greedy paths are not all one token
        for p in model.parameters():
            p.mul_(8.0 if p.dim() > 1 else 1.0)
        if kind == "qwen2":
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)
    return model


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_tiny_random_models_match_transformers(kind, tmp_path, model_dir):
    hf = save_tiny(kind, tmp_path, model_dir)
    prompts = [[5 + i * 7 + j for j in range(n)] for i, n in enumerate([3, 40, 90, 150])]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(ids):].tolist())
    llm = LLM(str(tmp_path), dtype="float32", block_size=16, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert len({t for r in refs for t in r}) > 3


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM(str(tmp_path / "nope"))


def test_dummy_load_format_needs_only_config_json(tmp_path, model_dir):
    """Random weights from config.json alone (benchmarks of shapes we have no weights for)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256,
               num_attention_heads=2, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", num_kv_blocks=16)
    model = llm.engine.runner.model
    assert torch.equal(model.norm.weight, torch.ones(128))
    w = model.layers[1].mlp.down_proj.weight
    assert w.shape == (128, 256) and 0 < w.abs().max().item() <= 0.02
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="npz")
