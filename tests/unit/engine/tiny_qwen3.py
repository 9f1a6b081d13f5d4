"""A tiny random Qwen3 checkpoint with a tokenizer and Qwen3's chat template (its `<think>`
handling and `enable_thinking`), saved by transformers itself: a reasoning model's shape,
small enough to serve in a second. The tokenizer is a byte-level BPE trained here on a few
sentences, with Qwen3's special tokens and its `<think>` / `</think>` / `<tool_call>`
markers as added tokens that are not special (decoding with `skip_special_tokens` keeps
them, as Qwen3's tokenizer does)."""

from __future__ import annotations

from pathlib import Path

import torch

TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the weather like in Paris today? It is sunny and warm.",
    'Call the function {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Let me think about this step by step, then answer the question.",
    "user assistant system tool response name arguments content",
]


def save_tiny_qwen3(path: Path, seed: int = 0) -> Path:
    """Save a 2-layer, hidden-64 Qwen3 and its tokenizer under `path`; the same `seed`
    gives the same weights. Returns `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _tokenizer()
    tokenizer.save_pretrained(path)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=1024, initializer_range=0.2,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    bpe.train_from_iterator(_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_tokens(MARKERS)  # added, not special: as in Qwen3's tokenizer
    tokenizer.chat_template = TEMPLATE
    return tokenizer
