"""Sparse mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Both are Llama-style layers whose MLP is replaced by a sparse MoE block (`SparseMoE`): a
replicated router linear picks each token's top-k experts, and the experts run as one
grouped matmul over stacked weights (`fused_moe.py`). Mixtral has Llama attention and an MoE
block in every layer; Qwen3-MoE has Qwen3's attention (`qwen3.py`: an RMSNorm over each q
and k head before rotary) and an MoE block in the layers `decoder_sparse_step` selects, a
dense MLP in the others and in `mlp_only_layers`. Router jitter (Mixtral's `router_jitter_noise`) is a
training-time noise and plays no part in inference.

Tensor parallelism: each rank holds every expert's slice of the intermediate size (gate/up
rows, down columns), so the block's output is a partial sum the layer all-reduces, as for a
dense MLP; the router is replicated, so every rank routes alike.

Checkpoints: the hub's per-expert tensors (Mixtral `block_sparse_moe.experts.E.w1/w3/w2`,
Qwen3-MoE `mlp.experts.E.gate_proj/up_proj/down_proj`) and transformers 5's stacked ones
(`mlp.experts.gate_up_proj` (E, 2I, h), `mlp.experts.down_proj` (E, h, I)) both reach the
stacked parameters through shards (expert, "gate" / "up" / "down").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from baton.engine.distributed import TPGroup, tp_group
from baton.engine.models.base import CausalLM, WeightPiece
from baton.engine.models.config import ModelConfig
from baton.engine.models.fused_moe import fused_experts, route
from baton.engine.models.layers import RMSNorm, VocabEmbedding, lm_head, set_loader
from baton.engine.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    map_llama_style,
)
from baton.engine.models.qwen3 import QWEN3_LAYER_WEIGHTS, QKNormAttention
from baton.engine.models.rope import RotaryEmbedding

__all__ = ["SparseMoE", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]


class SparseMoE(nn.Module):
    """Router (`gate`, replicated) + E experts stacked as `gate_up` (E, 2I, h), gate rows
    first, and `down` (E, h, I), I this rank's slice. Plain Parameters, not linears, so CPU
    packing leaves them as they are."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or tp_group()
        first, n = tp.split(intermediate, "an expert's intermediate size")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * n, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, n))
        experts = range(num_experts)

        def load_gate_up(param: nn.Parameter, loaded: torch.Tensor, shard) -> None:
            expert, part = _expert_of(param, shard)
            dst = 0 if part == "gate" else n
            param.data[expert].narrow(0, dst, n).copy_(loaded.narrow(0, first, n))

        def load_down(param: nn.Parameter, loaded: torch.Tensor, shard) -> None:
            expert, _ = _expert_of(param, shard)
            param.data[expert].copy_(loaded.narrow(1, first, n))

        set_loader(self.gate_up, load_gate_up, [(e, p) for e in experts for p in ("gate", "up")])
        set_loader(self.down, load_down, [(e, "down") for e in experts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, h) -> (T, h), partial sums under tensor parallelism."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # (T, k), (T, k)
        return fused_experts(x, self.gate_up, self.down, weights, ids)


def _expert_of(param: nn.Parameter, shard) -> tuple[int, str]:
    expert, part = shard
    if not 0 <= expert < param.shape[0]:
        raise ValueError(f"checkpoint has expert {expert}; the config says "
                         f"{param.shape[0]} experts")
    return expert, part


class MoEDecoderLayer(nn.Module):
    """A Llama layer's wiring around any attention and MLP (dense or sparse)."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = attn
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    forward = DecoderLayer.forward  # the same pre-norm residual wiring


class MoECausalLM(CausalLM):
    """The model around the layers `make_layer` builds: Llama's embedding, final norm,
    head and forward."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else lm_head(cfg.vocab_size,
                                                                     cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_positions)

    def make_layer(self, cfg: ModelConfig, idx: int) -> MoEDecoderLayer:
        raise NotImplementedError

    forward = LlamaForCausalLM.forward

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterable[WeightPiece]:
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return ()
        return map_moe_style(name, tensor, MOE_LAYER_WEIGHTS)


class MixtralForCausalLM(MoECausalLM):
    def make_layer(self, cfg: ModelConfig, idx: int) -> MoEDecoderLayer:
        hf = cfg.hf
        experts = _num_experts(hf, "num_local_experts")
        moe = SparseMoE(cfg.hidden_size, cfg.intermediate_size, experts,
                        _top_k(hf, experts), renormalize=True)
        return MoEDecoderLayer(cfg, Attention(cfg, idx), moe)


class Qwen3MoeForCausalLM(MoECausalLM):
    def make_layer(self, cfg: ModelConfig, idx: int) -> MoEDecoderLayer:
        hf = cfg.hf
        step = hf.get("decoder_sparse_step", 1)
        experts = _num_experts(hf, "num_experts")
        mlp: MLP | SparseMoE
        if idx in hf.get("mlp_only_layers", ()) or experts == 0 or (idx + 1) % step:
            mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            mlp = SparseMoE(cfg.hidden_size, hf["moe_intermediate_size"], experts,
                            _top_k(hf, experts), renormalize=bool(hf.get("norm_topk_prob", False)))
        return MoEDecoderLayer(cfg, QKNormAttention(cfg, idx), mlp)


def _num_experts(hf, key: str) -> int:
    # transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
    n = hf.get(key, hf.get("num_local_experts", hf.get("num_experts")))
    if n is None or n < 0:
        raise ValueError(f"config.json: {key} must be a count of experts >= 0, got {n!r}")
    return n


def _top_k(hf, experts: int) -> int:
    k = hf.get("num_experts_per_tok")
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"config.json: num_experts_per_tok must be in [1, {experts}] "
                         f"(the number of experts), got {k!r}")
    return k


# Inside `model.layers.N.`, beyond Llama's and Qwen3's (q/k norm) names: the MoE router.
MOE_LAYER_WEIGHTS = QWEN3_LAYER_WEIGHTS | {
    "mlp.gate": ("mlp.gate", None),
    "block_sparse_moe.gate": ("mlp.gate", None),
}
# A per-expert tensor's name -> which part of the stacked parameters it fills.
EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def map_moe_style(name: str, tensor: torch.Tensor, layer_map: Mapping[str, tuple[str, object]]
                  ) -> Iterable[WeightPiece]:
    """Hugging Face names -> ours: expert tensors (per expert or stacked) onto the stacked
    parameters' shards, everything else as `map_llama_style` maps it."""
    layer, sep, rest = name.removeprefix("model.layers.").partition(".experts.")
    if not (name.startswith("model.layers.") and sep):
        yield from map_llama_style(name, tensor, layer_map)
        return
    idx, _, block = layer.partition(".")
    if block not in ("mlp", "block_sparse_moe"):
        raise KeyError(f"unexpected checkpoint tensor {name!r}")
    ours = f"layers.{idx}.mlp"
    if rest == "gate_up_proj":  # (E, 2I, h), gate rows first
        gate, up = tensor.chunk(2, dim=1)
        for e in range(tensor.shape[0]):
            yield f"{ours}.gate_up", (e, "gate"), gate[e]
            yield f"{ours}.gate_up", (e, "up"), up[e]
    elif rest == "down_proj":  # (E, h, I)
        for e in range(tensor.shape[0]):
            yield f"{ours}.down", (e, "down"), tensor[e]
    else:  # E.<w1|w2|w3|gate_proj|up_proj|down_proj>.weight
        expert, proj, kind = (rest.split(".") + ["", ""])[:3]
        part = EXPERT_PARTS.get(proj)
        if part is None or kind != "weight" or not expert.isdigit():
            raise KeyError(f"unexpected checkpoint tensor {name!r}")
        param = "gate_up" if part in ("gate", "up") else "down"
        yield f"{ours}.{param}", (int(expert), part), tensor
