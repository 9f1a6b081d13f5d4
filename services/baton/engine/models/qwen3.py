"""Qwen3 (dense): Llama's layers with an RMSNorm over each q and k head before rotary, no
qkv bias, head_dim from the config (128 for every size, whatever the hidden size).

Shapes as in `llama.py`: T tokens, H / KVH this rank's heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from baton.engine.models.base import WeightPiece
from baton.engine.models.config import ModelConfig
from baton.engine.models.layers import RMSNorm
from baton.engine.models.llama import (
    LLAMA_LAYER_WEIGHTS,
    Attention,
    LlamaForCausalLM,
    map_llama_style,
)

QWEN3_LAYER_WEIGHTS = LLAMA_LAYER_WEIGHTS | {
    "self_attn.q_norm": ("attn.q_norm", None),
    "self_attn.k_norm": ("attn.k_norm", None),
}


class QKNormAttention(Attention):
    """Llama's attention with per-head RMSNorms on q and k (weights of size D, shared by
    every head) between the projection and rotary."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, qkv: torch.Tensor) -> torch.Tensor:
        T, H, KVH, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        q = self.q_norm.norm(q.view(T, H, D)).view(T, H * D)
        k = self.k_norm.norm(k.view(T, KVH, D)).view(T, KVH * D)
        return torch.cat((q, k, v), dim=-1)  # (T, (H + 2 KVH) D)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.attention_bias:
            raise ValueError("Qwen3 with attention_bias=true (a bias on o_proj too) is not "
                             "supported; Qwen3 checkpoints have none")
        super().__init__(cfg, max_positions)
        for i, layer in enumerate(self.layers):
            layer.attn = QKNormAttention(cfg, i)  # Llama's layer around Qwen3's attention

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterable[WeightPiece]:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return ()
        return map_llama_style(name, tensor, QWEN3_LAYER_WEIGHTS)
