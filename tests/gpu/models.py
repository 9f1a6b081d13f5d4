"""Random-weight Llama checkpoints for the GPU tests, built with transformers and saved as
safetensors beside the bundled model's tokenizer (prompts are token ids)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Llama-3-8B's layer shapes, two layers so it builds and loads in seconds.
LLAMA3_8B_2L = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, intermediate_size=14336, vocab_size=128256,
                    num_hidden_layers=2, max_position_embeddings=4096, rope_theta=500000.0)
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=49152, num_hidden_layers=2,
            max_position_embeddings=2048)


def save_random_llama(path: Path, tokenizer_dir: Path, shape: dict, device: torch.device,
                      seed: int = 0):
    """A float32 LlamaForCausalLM of `shape` with random weights (initializer_range 0.2, so
    greedy choices are not near-ties), saved to `path`; returns the model, left on `device`
    in eval mode for the Hugging Face reference."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape, initializer_range=0.2, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return model


def prompt_ids(count: int, vocab: int, seed: int = 0, lengths=(5, 17, 64, 200)) -> list[list[int]]:
    """`count` random prompts of the bundled tokenizer's ordinary ids (256 and up)."""
    gen = torch.Generator().manual_seed(seed)
    high = min(vocab, 49152)
    return [torch.randint(256, high, (lengths[i % len(lengths)],), generator=gen).tolist()
            for i in range(count)]
