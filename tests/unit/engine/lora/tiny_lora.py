"""A tiny random Llama saved by transformers and PEFT adapters over it saved by peft itself,
with the models they are as references (float32)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests.unit.engine.tiny_checkpoint import save_tiny_llama

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base(path: Path):
    """The tiny Llama (2 layers, hidden 64, vocab 1000) saved under `path`; its HF model."""
    from transformers import LlamaForCausalLM

    save_tiny_llama(path)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_adapter(base, path: Path, seed: int, r: int = 8, targets=ALL_LINEARS,
                 alpha: float = 16, use_rslora: bool = False, scale: float = 3.0, **config):
    """A PEFT LoRA adapter of `base` with random A and B (B scaled by `scale` so it changes
    the greedy path), saved under `path`; returns the PEFT model (eval, float32)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                     init_lora_weights=False, lora_dropout=0.0, **config)
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(path)
    return model
