"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama's layers under other checkpoint
names. The checkpoint fuses q, k, v into `self_attn.qkv_proj` and gate, up into
`mlp.gate_up_proj`; they are split here into the shards our fused parameters take, so each
piece is sliced by heads / features under tensor parallelism like Llama's separate tensors.

RoPE: default (4k models) or longrope (128k models: short / long factors and an attention
factor, `rope.py`), with `partial_rotary_factor` (Phi-4-mini rotates 3/4 of each head):
the q and k rows of each head are permuted at load (`rope.partial_rotary_order`) so the
whole-head tables rotate exactly Hugging Face's dims. Phi-3-mini's `sliding_window` applies
to every layer (`ModelConfig.window_of`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from baton.engine.models.base import WeightPiece
from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import LLAMA_LAYER_WEIGHTS, LlamaForCausalLM, map_llama_style
from baton.engine.models.rope import partial_rotary_order, rotary_dim

PHI3_LAYER_WEIGHTS = {k: v for k, v in LLAMA_LAYER_WEIGHTS.items()
                      if not k.startswith(("self_attn.q_", "self_attn.k_", "self_attn.v_",
                                           "mlp.gate_", "mlp.up_"))}


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.rotated_dims = rotary_dim(cfg)  # refuses an odd partial_rotary_factor early

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterable[WeightPiece]:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return ()
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith("self_attn.qkv_proj"):
            layer = prefix.removesuffix("self_attn.qkv_proj").removeprefix("model.")
            return self._qkv_pieces(f"{layer}attn.qkv_proj.{kind}", tensor)
        if prefix.endswith("mlp.gate_up_proj"):
            layer = prefix.removesuffix("mlp.gate_up_proj").removeprefix("model.")
            gate, up = tensor.chunk(2, dim=0)  # (I, h) each
            return [(f"{layer}mlp.gate_up_proj.{kind}", 0, gate),
                    (f"{layer}mlp.gate_up_proj.{kind}", 1, up)]
        return map_llama_style(name, tensor, PHI3_LAYER_WEIGHTS)

    def _qkv_pieces(self, param: str, fused: torch.Tensor) -> list[WeightPiece]:
        """The fused ((H + 2 KVH) D, h) checkpoint tensor -> q, k, v pieces, the q / k
        head dims in our rotary order."""
        D = self.cfg.head_dim
        q, k, v = fused.split([self.cfg.num_heads * D, self.cfg.num_kv_heads * D,
                               self.cfg.num_kv_heads * D], dim=0)
        if self.rotated_dims < D:
            order = partial_rotary_order(D, self.rotated_dims).to(fused.device)  # (D,)
            q, k = (_reorder_heads(t, order) for t in (q, k))
        return [(param, "q", q), (param, "k", k), (param, "v", v)]


def _reorder_heads(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(heads * D, ...) rows -> the same with each head's D rows taken in `order`."""
    per_head = rows.reshape(-1, order.numel(), *rows.shape[1:])  # (heads, D, ...)
    return per_head.index_select(1, order).reshape(rows.shape)
