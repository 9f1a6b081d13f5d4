"""Gemma 2 and Gemma 3 (text) over a flat, unpadded batch, built from Llama's blocks.

What differs from Llama, in both: the embedding is multiplied by sqrt(hidden) (rounded to
the model's dtype, as transformers does); every RMSNorm scales by (1 + w); each layer has
four norms — before and after attention, before and after the MLP — the "after" ones applied
to the block's output before the residual add; the MLP is GeGLU (tanh GELU); q.k is scaled
by `query_pre_attn_scalar ** -0.5`, not head_dim's; local (sliding-window) and global layers
alternate as `layer_types` says; the LM head is the embedding.

Gemma 2 also soft-caps attention scores (`attn_logit_softcapping`) and the final logits
(`final_logit_softcapping`). Gemma 3 drops both caps (transformers ignores an attention cap
in its config, and so do we) and adds a (1 + w) RMSNorm over each q and k head before
rotary; its local layers rotate with their own base (`rope_local_base_freq`, or
`rope_parameters["sliding_attention"]` in transformers 5 configs), its global layers with
the model's rope (`rope_theta`, linear scaling on the larger models).

Local and global layers share one block table: the KV manager cannot free blocks that fell
out of the local layers' window while the global layers still read them (that would take a
block table per layer group, as vLLM's hybrid KV manager keeps), so Gemma holds whole
sequences; the local layers only mask (`LayerAttention.sliding_window`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from baton.engine.attention.base import ForwardContext, LayerAttention
from baton.engine.models.base import CausalLM, WeightPiece
from baton.engine.models.config import SLIDING, ModelConfig
from baton.engine.models.layers import RMSNorm, VocabEmbedding, lm_head
from baton.engine.models.llama import LLAMA_LAYER_WEIGHTS, MLP, Attention, map_llama_style
from baton.engine.models.rope import RotaryEmbedding, StepRotary

GEMMA_LAYER_WEIGHTS = {
    **LLAMA_LAYER_WEIGHTS,
    "pre_feedforward_layernorm": ("pre_ff_norm", None),
    "post_feedforward_layernorm": ("post_ff_norm", None),
    "self_attn.q_norm": ("attn.q_norm", None),
    "self_attn.k_norm": ("attn.k_norm", None),
}

# Where a multimodal Gemma 3 checkpoint keeps its text model (transformers 4, then 5).
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


def gemma_norm(cfg: ModelConfig, size: int | None = None) -> RMSNorm:
    return RMSNorm(size or cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)


def _activation(cfg: ModelConfig) -> str:
    act = cfg.hf.get("hidden_activation") or cfg.hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{cfg.architecture}: hidden_activation {act!r} is not supported "
                         f"(gelu_pytorch_tanh)")
    return "gelu_tanh"


class QKNormAttention(Attention):
    """Gemma 3's attention: each q and k head RMS-normed ((1 + w), over head_dim) between
    the projection and rotary."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, spec: LayerAttention) -> None:
        super().__init__(cfg, layer_idx, spec=spec)
        self.q_norm = gemma_norm(cfg, cfg.head_dim)
        self.k_norm = gemma_norm(cfg, cfg.head_dim)

    def project(self, qkv: torch.Tensor) -> torch.Tensor:
        T, H, KVH, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:self.qk_size].view(T, KVH, D)
        q.copy_(self.q_norm.norm(q))  # in place: qkv is this step's fresh projection
        k.copy_(self.k_norm.norm(k))
        return qkv


class GemmaDecoderLayer(nn.Module):
    """input norm -> attention -> post-attention norm -> + residual -> pre-FF norm -> MLP
    -> post-FF norm -> + residual. The residual add is deferred into the next norm (as
    Llama's layers do): the stream is x + residual."""

    def __init__(self, cfg: ModelConfig, attn: Attention) -> None:
        super().__init__()
        self.input_norm = gemma_norm(cfg)
        self.attn = attn
        self.post_attn_norm = gemma_norm(cfg)
        self.pre_ff_norm = gemma_norm(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=_activation(cfg))
        self.post_ff_norm = gemma_norm(cfg)

    def forward(self, x, residual, rope: StepRotary, ctx: ForwardContext, tp):
        h, residual = self.input_norm(x, residual)  # residual: the stream so far
        h = self.post_attn_norm.norm(tp.all_reduce(self.attn(h, rope, ctx)))
        h, residual = self.pre_ff_norm(h, residual)
        return self.post_ff_norm.norm(tp.all_reduce(self.mlp(h))), residual


class GemmaForCausalLM(CausalLM):
    """What Gemma 2 and 3 share; subclasses build the attention of each layer. Settings a
    config.json leaves out take transformers' defaults for the architecture."""

    default_final_softcap: float | None = None

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        # Gemma ties its head unless the config says otherwise (its configs often omit it).
        cfg = dataclasses.replace(cfg, tie_word_embeddings=bool(
            cfg.hf.get("tie_word_embeddings", True)))
        super().__init__(cfg)
        self.max_positions = max_positions
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size,
                                           scale=cfg.hidden_size ** 0.5)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, self.make_attention(cfg, i))
                                    for i in range(cfg.num_layers))
        self.norm = gemma_norm(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else lm_head(cfg.vocab_size,
                                                                     cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_positions)
        self.final_logit_softcap = self.softcap(cfg, "final_logit_softcapping",
                                                self.default_final_softcap)
        # Local layers by type, even where the config sets no window (their rope differs).
        types = cfg.hf.get("layer_types") or cfg.layer_types
        self.local_layers = frozenset(i for i, t in enumerate(types) if t == SLIDING)

    @staticmethod
    def softcap(cfg: ModelConfig, key: str, default: float | None) -> float | None:
        cap = cfg.hf.get(key, default)  # an explicit null turns it off
        return None if cap is None else float(cap)

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        raise NotImplementedError

    def scale(self, cfg: ModelConfig) -> float:
        return float(cfg.hf.get("query_pre_attn_scalar") or 256) ** -0.5

    def step_ropes(self, positions: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[StepRotary, StepRotary]:
        """(global, local) rotations of this step; the same one unless overridden."""
        rope = self.rotary.for_step(positions, dtype)
        return rope, rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, h), scaled
        global_rope, local_rope = self.step_ropes(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            rope = local_rope if i in self.local_layers else global_rope
            x, residual = layer(x, residual, rope, ctx, self.tp)
        x, _ = self.norm(x, residual)
        return x

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterable[WeightPiece]:
        if name.startswith(_VISION):
            return ()
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            if self.cfg.tie_word_embeddings:
                return ()
            name = "lm_head.weight"
        return map_llama_style(name, tensor, GEMMA_LAYER_WEIGHTS)


class Gemma2ForCausalLM(GemmaForCausalLM):
    default_final_softcap = 30.0

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        spec = LayerAttention(self.scale(cfg), cfg.window_of(layer_idx),
                              self.softcap(cfg, "attn_logit_softcapping", 50.0))
        return Attention(cfg, layer_idx, spec=spec)


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Local layers rotate with `local_rope_config`'s table, built on first use on the
    step's device (the loader rebuilds only `rotary`, the global one, after materialising
    the model from the meta device)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.local_cfg = local_rope_config(self.cfg)
        self.local_rotary: RotaryEmbedding | None = None

    def make_attention(self, cfg: ModelConfig, layer_idx: int) -> Attention:
        spec = LayerAttention(self.scale(cfg), cfg.window_of(layer_idx))
        return QKNormAttention(cfg, layer_idx, spec)

    def step_ropes(self, positions, dtype):
        table = self.local_rotary
        if table is None or table.cos.device != positions.device:
            with torch.device(positions.device):
                table = self.local_rotary = RotaryEmbedding(self.local_cfg,
                                                            self.max_positions)
            table.kernel = self.rotary.kernel  # the platform's, if it set one
        return self.rotary.for_step(positions, dtype), table.for_step(positions, dtype)


def local_rope_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the local layers' rope: transformers 5's per-layer-type
    `rope_parameters["sliding_attention"]`, else `rope_local_base_freq` (default 10000)
    without scaling (older configs' `rope_scaling` is the global layers')."""
    per_type = cfg.hf.get("rope_parameters") or {}
    local = per_type.get(SLIDING) if isinstance(per_type.get(SLIDING), dict) else None
    if local is None:
        theta = cfg.hf.get("rope_local_base_freq", 10000.0)
        return dataclasses.replace(cfg, rope_theta=float(theta), rope_scaling=None)
    scaling = None
    if local.get("rope_type", "default") != "default":
        scaling = tuple(sorted((k, v) for k, v in local.items()
                               if k != "rope_theta" and not isinstance(v, (dict, list))))
    return dataclasses.replace(cfg, rope_theta=float(local.get("rope_theta", 10000.0)),
                               rope_scaling=scaling)
