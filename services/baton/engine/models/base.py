"""What every architecture's model shares: the contract the runner calls, weight loading
from checkpoint tensors one at a time, and the logits.

An architecture (`llama.py`, `gemma.py`, ...) subclasses `CausalLM`, builds its layers from
`layers.py` in `__init__(cfg, max_positions)`, and says how Hugging Face names map onto its
parameters in `checkpoint_weights`. Models are built on the `meta` device and materialised on
the target device before loading, so host memory never holds the whole checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from baton.engine.attention.base import ForwardContext, LayerAttention
from baton.engine.attention.kv_quant import record_kv_scale
from baton.engine.distributed import tp_group
from baton.engine.models.config import ModelConfig
from baton.engine.models.layers import VocabEmbedding, copy_loader, gather_logits

if TYPE_CHECKING:
    from baton.engine.models.rope import RotaryEmbedding

# (parameter name, shard, tensor): one checkpoint tensor's contribution to a parameter.
WeightPiece = tuple[str, object, torch.Tensor]


class CausalLM(nn.Module):
    """A decoder-only LM over a flat, unpadded batch.

    Subclasses set `embed_tokens` (a `VocabEmbedding`), `norm`, `lm_head` (None when tied),
    `rotary` (rebuilt by the loader after materialising) and implement `forward`. What a
    device does to the loaded model (packing, fused kernels) is its platform's
    (`engine/platforms/`)."""

    final_logit_softcap: float | None = None
    # what subclasses set in __init__ (declared only: no class attributes)
    embed_tokens: VocabEmbedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module | None
    rotary: RotaryEmbedding

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp_group()
        # FP8 KV cache scales the checkpoint carries, by (layer, "k" | "v") (`kv_quant`).
        self.kv_scales: dict[tuple[int, str], float] = {}

    # -- the runner's contract -----------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """(T,) token ids and positions -> (T, h) final hidden states."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, h) -> (N, V) float32 logits (gathered over ranks, soft-capped if the
        architecture caps them)."""
        if self.lm_head is None:
            local = nn.functional.linear(hidden, self.embed_tokens.weight)  # (N, rows)
        else:
            local = self.lm_head(hidden)
        logits = gather_logits(local, self.cfg.vocab_size, self.tp)
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def own_head(self) -> None:
        """A tied head becomes a linear over the embedding's weight (shared, not copied), for
        what replaces or wraps `lm_head` (packing, quantization, LoRA)."""
        if self.lm_head is None:
            weight = self.embed_tokens.weight
            self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                                     dtype=weight.dtype, device="meta")
            self.lm_head.weight = weight

    def attention_specs(self) -> list[LayerAttention]:
        """How each layer attends (scale, window, soft-cap), by layer index."""
        # each layer's `attn` is an attention module with a `spec`; torch types the
        # dynamic submodule lookup as Tensor | Module, hence the cast
        return [cast(Any, layer).attn.spec for layer in self.layers]

    # -- loading -------------------------------------------------------------------------
    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterable[WeightPiece]:
        """Where a checkpoint tensor goes: (our parameter, shard, tensor) pieces; nothing
        for tensors we do not use (rotary caches). Subclasses map Hugging Face names."""
        raise NotImplementedError

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (name, tensor), one at a time, into the parameters;
        raises KeyError naming what the checkpoint lacks. KV cache scales go to
        `kv_scales` (`kv_quant.record_kv_scale`), not to parameters."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in tensors:
            if record_kv_scale(self.kv_scales, name, tensor):
                continue
            for pname, shard, piece in self.checkpoint_weights(name, tensor):
                param = params.get(pname)
                if param is None:
                    raise KeyError(f"checkpoint tensor {name!r} maps to {pname!r}, which "
                                   f"{self.cfg.architecture} does not have")
                loader = getattr(param, "weight_loader", copy_loader)
                with torch.no_grad():
                    loader(param, piece.to(device=param.device, dtype=param.dtype), shard)
                loaded.add((pname, shard))
        missing = [f"{p}" + ("" if s is None else f"[{s}]")
                   for p, param in params.items()
                   for s in sorted(getattr(param, "shards", (None,)), key=str)
                   if (p, s) not in loaded and not self._tied(p)]
        if missing:
            raise KeyError(f"checkpoint lacks weights needed by {self.cfg.architecture}: "
                           f"{', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))

    def _tied(self, pname: str) -> bool:
        return pname == "lm_head.weight" and self.cfg.tie_word_embeddings
