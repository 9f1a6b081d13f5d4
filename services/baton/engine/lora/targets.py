"""The linears an adapter may adapt, as the loaded model has them: each one's input and
output sizes and, for a fused one (q/k/v, gate/up), where each part's rows sit in its output.
Read once from the freshly loaded model, before the platform swaps its `nn.Linear`s for
packed or quantized ones (which keep neither the layout nor the type)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine.lora.errors import LoRAError
from baton.engine.lora.peft_files import PeftAdapter
from baton.engine.models.base import CausalLM

# Our module names a LoRA may target: every linear of a decoder layer's attention and MLP,
# the token embedding and the LM head (tied to the embedding or not).
TARGET_LEAVES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
EMBEDDING, HEAD = "embed_tokens", "lm_head"


@dataclass(frozen=True)
class LoRATarget:
    """A linear (`layers.N.attn.qkv_proj`): `parts` maps each checkpoint part it fuses
    ("q", "k", "v"; 0, 1; None when it fuses none) to (first output row, rows)."""

    in_features: int
    out_features: int
    parts: dict[object, tuple[int, int]]

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def part_index(self, part: object) -> int:
        return list(self.parts).index(part)


def lora_targets(model: CausalLM) -> dict[str, LoRATarget]:
    """Every adaptable linear of `model` by its module name; call before the platform
    prepares the model. LoRAError when the model has none Baton can adapt."""
    targets = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in TARGET_LEAVES and type(module) is nn.Linear:
            rows = getattr(module, "shard_rows", None) or {None: (0, module.out_features)}
            targets[name] = LoRATarget(module.in_features, module.out_features, dict(rows))
    if not targets:
        raise LoRAError(f"{model.cfg.architecture}: no decoder linears Baton can adapt "
                        "(LoRA serves Llama-style q/k/v/o and gate/up/down projections)")
    vocab, hidden = model.cfg.vocab_size, model.cfg.hidden_size
    if model.embed_tokens.scale is None:  # Gemma scales its embeddings: no embedding LoRA
        targets[EMBEDDING] = LoRATarget(vocab, hidden, {None: (0, hidden)})
    targets[HEAD] = LoRATarget(hidden, vocab, {None: (0, vocab)})
    return targets


def _our_name(module: str) -> str | None:
    """The embedding's and head's names as ours (`model.embed_tokens` -> `embed_tokens`)."""
    leaf = module.rpartition(".")[2]
    return leaf if leaf in (EMBEDDING, HEAD) else None


@dataclass(frozen=True)
class TargetPiece:
    """Part `part` of our linear `target` takes A (r, in) and these rows of B (rows, r)."""

    target: str
    part: object
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def map_to_targets(name: str, model: CausalLM, targets: dict[str, LoRATarget],
                   adapter: PeftAdapter) -> list[TargetPiece]:
    """The adapter's modules as pieces of our linears (and embedding), through the model's
    own checkpoint name mapping (which splits a fused checkpoint tensor's rows as it splits B's);
    LoRAError naming a module the model has no adaptable linear for, or a shape that does
    not fit it."""
    pieces = []
    for module, lora in adapter.modules.items():
        ours = _our_name(module)
        try:
            mapped = [] if ours else list(model.checkpoint_weights(f"{module}.weight", lora.b))
        except KeyError:
            mapped = []
        saved = adapter.base_shapes.get(module)
        if ours and saved is not None and saved != (model.cfg.vocab_size, model.cfg.hidden_size):
            raise LoRAError(f"LoRA adapter {name!r} was trained over a {module} of shape "
                            f"{saved}, not the base model's ({model.cfg.vocab_size}, "
                            f"{model.cfg.hidden_size}): a resized vocabulary is not served")
        if ours == EMBEDDING and EMBEDDING not in targets:
            raise LoRAError(f"LoRA adapter {name!r} adapts {module}, the token embedding, "
                            f"which Baton does not adapt on {model.cfg.architecture} (its "
                            "embeddings are scaled)")
        for pname, part, b in mapped or [(ours or module, None, lora.b)]:
            target = pname.removesuffix(".weight")
            spec = targets.get(target)
            if spec is None or part not in spec.parts:
                raise LoRAError(f"LoRA adapter {name!r} adapts {module}, which is not a "
                                "q/k/v/o or gate/up/down linear, the embedding or the head "
                                f"of this {model.cfg.architecture} model")
            rows = spec.parts[part][1]
            if tuple(b.shape) != (rows, lora.rank) or lora.a.shape[1] != spec.in_features:
                raise LoRAError(f"LoRA adapter {name!r}: {module}'s A {tuple(lora.a.shape)} "
                                f"and B {tuple(lora.b.shape)} do not fit the base model's "
                                f"linear ({spec.in_features} -> {rows}); was it trained on "
                                "another base model?")
            pieces.append(TargetPiece(target, part, lora.a, b, lora.scaling))
    return pieces
