"""A tiny random Llama checkpoint saved by transformers itself (no tokenizer files): what
`save_pretrained` writes for a real model, small enough to load in a second."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 1000
MAX_POSITIONS = 512


def save_tiny_llama(path: Path, seed: int = 0, vocab: int = VOCAB, **save_kwargs) -> Path:
    """Save a 2-layer, hidden-64 Llama under `path` (`save_kwargs` go to `save_pretrained`,
    e.g. `max_shard_size`); the same `seed` gives the same weights. Returns `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_POSITIONS, initializer_range=0.2,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, **save_kwargs)
    return path
