"""`LoRALinear`: a base linear — whatever runs it: `nn.Linear`, the CPU's packed bf16 GEMM,
a GGUF-quantized kernel — plus the deltas of the step's adapters, row by row:

    y = base(x) + sum over slots s of mask[:, s] * (x @ A_s^T) @ B_s^T

computed for every resident slot at once as two matmuls over the slots' stacked buffers
(`adapter.py`'s layout): the shrink (T, in) @ (in, n R) -> (T, n R), each row's columns of
the slots it does not use zeroed by the step's mask, then the expand (T, n R) @ (n R, out)
added onto the base output. A row of the base model gets exact zeros added: its output is
the base linear's, bit for bit. Without adapter rows in the step (`mask` None) it is the
base linear alone.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRAStepState:
    """The step's rows -> slots, shared by every LoRALinear of a model and set by the
    runner's `LoRAManager` before each forward (the engine thread): `mask` (T, n, 1) in the
    model's dtype, 1 where row t uses slot s (n: the highest slot in use + 1), or None
    when no row of the step uses an adapter."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """`base` with the step's LoRA deltas. `a` (slots, P R, in) and `b` (slots, P R, out)
    are the resident adapters' buffers (`slots.py` fills them)."""

    a: torch.Tensor
    b: torch.Tensor

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor,
                 state: LoRAStepState) -> None:
        super().__init__()
        self.base, self.state = base, state
        self.register_buffer("a", a, persistent=False)
        self.register_buffer("b", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (T, out)
        mask = self.state.mask
        if mask is None:
            return y
        n, rank = mask.shape[1], self.a.shape[1]
        shrunk = x @ self.a[:n].reshape(n * rank, -1).t()  # (T, n R)
        shrunk = (shrunk.view(-1, n, rank) * mask).view(-1, n * rank)  # (T, n R)
        return torch.addmm(y, shrunk, self.b[:n].reshape(n * rank, -1))  # (T, out)
