"""Random-weight PEFT LoRA adapters for a base model, written as peft writes them
(`adapter_config.json` + `adapter_model.safetensors`) from the base's `config.json` alone:
what `lora_bench.py` serves and the tests of LoRA over the bundled model load."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Hugging Face's names of a Llama-style layer's linears -> (input, output) sizes from config
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_shapes(config: dict) -> dict[str, tuple[str, int, int]]:
    """module -> (its parent in the layer, in, out) for a Llama-style config.json."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads) * d
    return {"q_proj": ("self_attn", h, heads * d), "k_proj": ("self_attn", h, kv),
            "v_proj": ("self_attn", h, kv), "o_proj": ("self_attn", heads * d, h),
            "gate_proj": ("mlp", h, inter), "up_proj": ("mlp", h, inter),
            "down_proj": ("mlp", inter, h)}


def write_random_adapter(base_dir: Path, out: Path, seed: int, r: int = 16,
                         targets: tuple[str, ...] = ALL_LINEARS, alpha: float = 32,
                         std: float = 0.02) -> Path:
    """An adapter of rank `r` over `targets` in every layer of the model in `base_dir`,
    A and B drawn N(0, std^2) under `seed`; written to `out`, returned."""
    config = json.loads((base_dir / "config.json").read_text())
    shapes = linear_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            parent, n_in, n_out = shapes[name]
            stem = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) * std
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
        "bias": "none", "base_model_name_or_path": str(base_dir), "task_type": "CAUSAL_LM"}))
    return out
