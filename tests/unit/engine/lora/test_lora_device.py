"""LoRA's device code never reads values back to the host: the embedding's deltas and a
linear's (the head's, over its logits rows; a fused linear's, per part) run whole on `meta`
tensors, where any read-back, boolean-mask indexing or data-dependent shape raises."""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.lora.layer import LoRAEmbedding, LoRALinear, LoRAStepState

META = torch.device("meta")
T, V, H, R, SLOTS = 5, 50, 8, 4, 3


def empty(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device=META)


def test_the_embedding_and_linear_deltas_run_on_meta():
    state = LoRAStepState()
    state.mask, state.row_slots = empty(T, SLOTS, 1), empty(T, dtype=torch.int64)
    state.slots = frozenset({0, 2})
    embedding = LoRAEmbedding(nn.Embedding(V, H, device=META, dtype=torch.bfloat16),
                              empty(SLOTS, R, V), [empty(SLOTS, R, H)], state)
    embedding.adapted = {2}
    out = embedding(empty(T, dtype=torch.int64))
    assert out.is_meta and out.shape == (T, H) and out.dtype == torch.bfloat16

    fused = LoRALinear(nn.Linear(H, 12, bias=False, device=META, dtype=torch.bfloat16),
                       empty(SLOTS, 2 * R, H), [empty(SLOTS, R, 8), empty(SLOTS, R, 4)],
                       [(0, 8), (8, 4)], state)
    fused.adapted = {0}
    assert fused(empty(T, H)).shape == (T, 12)

    head = LoRALinear(nn.Linear(H, V, bias=False, device=META, dtype=torch.float32),
                      empty(SLOTS, R, H), [empty(SLOTS, R, V)], [(0, V)], state, head=True)
    head.adapted = {1}
    state.head_mask, state.head_row_slots = empty(2, SLOTS, 1), empty(2, dtype=torch.int64)
    state.head_slots = frozenset({1})
    logits = head(empty(2, H, dtype=torch.float32))  # float32 logits, bf16 adapters
    assert logits.is_meta and logits.shape == (2, V) and logits.dtype == torch.float32
