"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flat, unpadded batch.

Shapes: T tokens in the step, h hidden, H query heads, KVH kv heads, D head dim.
Attention is delegated to the step's backend through the ForwardContext, which also holds
this layer's KV cache; the module itself is stateless between steps. On CPU the norms,
SiLU * up and rotary run as fused native kernels when they could be built
(`use_native_ops`, `cpu_ops.py`); the torch code here is the fallback and their reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.attention.base import ForwardContext
from baton.engine.models.config import ModelConfig
from baton.engine.models.cpu_ops import CpuOps
from baton.engine.models.rope import RotaryEmbedding, StepRotary


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as Hugging Face does), with the residual add fused in:
    returns (norm(x + residual), x + residual)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native: CpuOps | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.native is not None:
            return self.native.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype), x


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qk_size = q_size + kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(self, x, rope: StepRotary, ctx: ForwardContext) -> torch.Tensor:
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 KVH) D)
        q, k = rope(qkv, H, KVH, D)  # (T, H, D), (T, KVH, D)
        v = qkv[:, self.qk_size:].view(T, KVH, D)  # (T, KVH, D)
        out = ctx.attention(self.layer_idx, q, k, v)  # (T, H, D)
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.native: CpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 I)
        if self.native is not None:
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, residual, rope: StepRotary, ctx):
        h, residual = self.input_norm(x, residual)
        h = self.attn(h, rope, ctx)
        h, residual = self.post_attn_norm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.native: CpuOps | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """(T,) token ids and positions -> (T, h) final hidden states."""
        x = self.embed_tokens(input_ids)  # (T, h)
        rope = self.rotary.for_step(positions, x.dtype, self.native)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, h) -> (N, V) float32 logits."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def use_native_ops(self, ops: CpuOps | None) -> None:
        """Run the norms, SiLU * up and rotary through `ops` (native CPU kernels), or through
        torch when None. Mutates this model's modules; may be switched between steps."""
        self.native = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.native = ops

    def prepack_for_cpu(self, cache_dir) -> None:
        """Swap linears for packed ones (`cpu_packing`: the native GEMM, else oneDNN's; bf16
        on CPU; `cache_dir` holds the built kernels); a tied head gets its own packed copy of
        the embedding."""
        from baton.engine.models.cpu_packing import load_linear_kernels, pack_linears

        if self.lm_head is None:
            self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False,
                                     device=self.embed_tokens.weight.device,
                                     dtype=self.embed_tokens.weight.dtype)
            self.lm_head.weight = self.embed_tokens.weight
        pack_linears(self, load_linear_kernels(cache_dir))
