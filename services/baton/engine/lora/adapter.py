"""`LoRAAdapter`: one adapter's host copy, laid out as the resident buffers take it, so
making it resident is one copy per linear (`slots.py`).

Layout, for a target linear fusing P parts (q/k/v: 3, gate/up: 2, else 1) and the engine's
`max_lora_rank` R: A is (P R, in) — part p's A in rows [p R, p R + r), zeros after — and B
is (P R, out), transposed — part p's B^T in the same rows, at its columns of the fused
output — with the scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded in. The zero
rows make every adapter one shape whatever its rank, and add exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.common.hashing import lora_root_hash
from baton.engine.lora.pace import give_way
from baton.engine.lora.peft_files import PeftAdapter
from baton.engine.lora.targets import LoRATarget, TargetPiece, map_to_targets
from baton.engine.models.base import CausalLM


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """`load_id`: unique to this host copy (a reload is another copy); `root_hash`: where
    its requests' KV block hashes chain from (`common.hashing.lora_root_hash`);
    `weights`: target linear -> (A (P R, in), B^T (P R, out)) in the model's dtype."""

    name: str
    path: str
    load_id: int
    digest: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def root_hash(self) -> int:
        return lora_root_hash(self.digest)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def build_adapter(name: str, path: str, load_id: int, peft: PeftAdapter, model: CausalLM,
                  targets: dict[str, LoRATarget], max_rank: int,
                  dtype: torch.dtype) -> LoRAAdapter:
    """The host copy of `peft` for this model (LoRAError where it does not fit it)."""
    pieces = map_to_targets(name, model, targets, peft)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for piece in pieces:
        give_way()
        spec = targets[piece.target]
        if piece.target not in weights:
            rows = spec.num_parts * max_rank
            weights[piece.target] = (torch.zeros(rows, spec.in_features),
                                     torch.zeros(rows, spec.out_features))
        _place(weights[piece.target], spec, piece, max_rank)
    laid_out = {}
    for target, (a, bt) in weights.items():
        give_way()
        laid_out[target] = (a.to(dtype), bt.to(dtype))
    return LoRAAdapter(name, path, load_id, peft.digest, peft.rank, laid_out)


def _place(buffers: tuple[torch.Tensor, torch.Tensor], spec: LoRATarget, piece: TargetPiece,
           max_rank: int) -> None:
    a, bt = buffers  # (P R, in), (P R, out) float32
    r = piece.a.shape[0]
    first = spec.part_index(piece.part) * max_rank
    col, cols = spec.parts[piece.part]
    a[first:first + r] = piece.a  # (r, in)
    bt[first:first + r, col:col + cols] = piece.b.t() * piece.scaling  # (r, rows)
