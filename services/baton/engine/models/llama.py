"""Llama-family decoder (Llama 1/2/3/3.1, Mistral, Qwen2/2.5, SmolLM) over a flat, unpadded
batch, and the attention / MLP / layer blocks other architectures reuse.

Shapes: T tokens in the step, h hidden, H query heads, KVH kv heads (this rank's), D head
dim. Attention is delegated to the step's backend through the ForwardContext, which also
holds this layer's KV cache; the module itself is stateless between steps. On CPU the
platform swaps the norms, the SiLU MLP and rotary for fused C kernels, and runs decode steps of
these layers in one C call (`platforms/cpu_layers.py`); the torch code here is their fallback.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.attention.base import ForwardContext, LayerAttention
from baton.engine.models.base import CausalLM, WeightPiece
from baton.engine.models.config import ModelConfig
from baton.engine.models.layers import (
    RMSNorm,
    VocabEmbedding,
    lm_head,
    local_heads,
    merged_linear,
    qkv_linear,
    row_linear,
)
from baton.engine.models.rope import RotaryEmbedding, StepRotary

__all__ = ["RMSNorm", "Attention", "MLP", "DecoderLayer", "LlamaForCausalLM"]


class Attention(nn.Module):
    """Fused qkv projection, rotary, the backend's paged attention, o projection (whose
    partial sums the caller's all-reduce completes under tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, bias: bool | None = None,
                 spec: LayerAttention | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        D = cfg.head_dim
        self.num_heads = local_heads(cfg.num_heads)
        self.num_kv_heads = local_heads(cfg.num_kv_heads)
        self.head_dim = D
        self.qk_size = (self.num_heads + self.num_kv_heads) * D
        bias = cfg.attention_bias if bias is None else bias
        self.qkv_proj = qkv_linear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, D, bias)
        self.o_proj = row_linear(cfg.num_heads * D, cfg.hidden_size, bias=False)
        self.spec = spec or LayerAttention(D ** -0.5, cfg.window_of(layer_idx))

    def project(self, qkv: torch.Tensor) -> torch.Tensor:
        """Hook between the projection and rotary (Qwen3's q/k norms); identity here."""
        return qkv

    def forward(self, x, rope: StepRotary, ctx: ForwardContext) -> torch.Tensor:
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.project(self.qkv_proj(x))  # (T, (H + 2 KVH) D)
        q, k = rope(qkv, H, KVH, D)  # (T, H, D), (T, KVH, D)
        v = qkv[:, self.qk_size:].view(T, KVH, D)  # (T, KVH, D)
        out = ctx.attention(self.layer_idx, q, k, v, self.spec)  # (T, H, D)
        return self.o_proj(out.reshape(T, -1))  # partial sums under TP


class MLP(nn.Module):
    """Gated MLP: down(act(gate) * up), gate and up fused; `act` "silu" or "gelu_tanh"
    (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = merged_linear(hidden, [intermediate, intermediate])
        self.down_proj = row_linear(intermediate, hidden)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 I)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act == "silu":
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, residual, rope: StepRotary, ctx, tp):
        h, residual = self.input_norm(x, residual)
        h = tp.all_reduce(self.attn(h, rope, ctx))
        h, residual = self.post_attn_norm(h, residual)
        return tp.all_reduce(self.mlp(h)), residual


# Hugging Face's names inside a Llama-style layer -> (ours, shard).
LLAMA_LAYER_WEIGHTS = {
    "self_attn.q_proj": ("attn.qkv_proj", "q"),
    "self_attn.k_proj": ("attn.qkv_proj", "k"),
    "self_attn.v_proj": ("attn.qkv_proj", "v"),
    "self_attn.o_proj": ("attn.o_proj", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", None),
    "input_layernorm": ("input_norm", None),
    "post_attention_layernorm": ("post_attn_norm", None),
}


def map_llama_style(name: str, tensor: torch.Tensor,
                    layer_map: Mapping[str, tuple[str, object]]) -> Iterable[WeightPiece]:
    """Hugging Face `model.*` / `lm_head.*` names -> ours, via `layer_map` for the names
    inside `model.layers.N.` (keys without the `.weight` / `.bias` suffix)."""
    if name.startswith("model.layers."):
        idx, rest = name[len("model.layers."):].split(".", 1)
        stem, _, kind = rest.rpartition(".")
        target = layer_map.get(stem)
        if target is None:
            raise KeyError(f"unexpected checkpoint tensor {name!r}")
        yield f"layers.{idx}.{target[0]}.{kind}", target[1], tensor
    elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        yield name.removeprefix("model."), None, tensor
    elif "rotary_emb" not in name:
        raise KeyError(f"unexpected checkpoint tensor {name!r}")


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else lm_head(cfg.vocab_size,
                                                                     cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, h)
        rope = self.rotary.for_step(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx, self.tp)
        x, _ = self.norm(x, residual)
        return x

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterable[WeightPiece]:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return ()
        return map_llama_style(name, tensor, LLAMA_LAYER_WEIGHTS)
