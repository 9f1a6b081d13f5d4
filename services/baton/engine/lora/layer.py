"""`LoRALinear`: a base linear — whatever runs it: `nn.Linear`, the CPU's packed bf16 GEMM,
a GGUF-quantized kernel — plus the deltas of the step's adapters, row by row:

    y = base(x) + sum over slots s of mask[:, s] * (x @ A_s^T) @ B_s^T

computed for every resident slot at once over the slots' stacked buffers: the shrink
(T, in) @ (in, n P R) -> (T, n P R), each row's columns of the slots it does not use zeroed
by the step's mask, then, per part of a fused linear (q / k / v, gate / up; one part
otherwise), the expand (T, n R) @ (n R, cols) added onto that part's columns of the base
output. A row of the base model gets exact zeros added: its output is the base linear's,
bit for bit. Without adapter rows in the step (`mask` None) it is the base linear alone.

On CPU in bf16 the delta is `baton_cpu.lora`'s kernel instead (each row its own adapter's
shrink and expand, float32 between them), the one the one-call decode step calls after
each linear: a step's adapter rows get the same bits whichever path runs them. On CUDA it
is `baton_kernels.lora`'s Triton kernels, computing the same.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn


class DeltaKernel(Protocol):
    """A kernel for the deltas (`baton_cpu.lora.NativeLoRA`, `baton_kernels.lora.TritonLoRA`):
    `describe` a linear's buffers once; `add` adds each row's delta onto y in place."""

    def describe(self, a: torch.Tensor, b: list[torch.Tensor], parts: list[tuple[int, int]],
                 out_features: int) -> Any: ...

    def add(self, desc: Any, x: torch.Tensor, row_slots: torch.Tensor,
            y: torch.Tensor) -> None: ...


class LoRAStepState:
    """The step's rows -> slots, shared by every LoRALinear of a model and set by the
    runner's `LoRAManager` before each forward (the engine thread): `mask` (T, n, 1) in the
    model's dtype, 1 where row t uses slot s (n: the highest slot in use + 1), or None
    when no row of the step uses an adapter; `row_slots` (T,) int64 on the CPU, each row's
    slot (-1: the base model), set with it."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.row_slots: torch.Tensor | None = None
        self.slots: frozenset[int] = frozenset()  # the slots the step's rows use
        # the same for the rows the LM head computes logits of (`LoRAManager.logits_rows`)
        self.head_mask: torch.Tensor | None = None
        self.head_row_slots: torch.Tensor | None = None
        self.head_slots: frozenset[int] = frozenset()

    def rows(self, head: bool, adapted: set[int]
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(mask, row_slots) of the decoder's token rows, or of the head's logits rows;
        (None, None) when none of their slots holds an adapter of the module asking (its
        `adapted` slots): the module then adds nothing and computes nothing."""
        if head:
            mask, row_slots, slots = self.head_mask, self.head_row_slots, self.head_slots
        else:
            mask, row_slots, slots = self.mask, self.row_slots, self.slots
        return (mask, row_slots) if slots & adapted else (None, None)


class LoRALinear(nn.Module):
    """`base` with the step's LoRA deltas. `a` (slots, P R, in): every part's A stacked;
    `b[p]` (slots, R, cols_p): part p's B^T, scaled, for output columns `parts[p]` =
    (first, count). `slots.py` fills them. `native`: the device's delta kernel, where one
    runs (else two torch matmuls). `head`: the LM head, whose rows are the step's logits
    rows, not its tokens."""

    a: torch.Tensor

    def __init__(self, base: nn.Module, a: torch.Tensor, b: list[torch.Tensor],
                 parts: list[tuple[int, int]], state: LoRAStepState,
                 native: DeltaKernel | None = None, head: bool = False) -> None:
        super().__init__()
        self.base, self.state, self.parts, self.head = base, state, parts, head
        self.adapted: set[int] = set()  # the slots whose adapter adapts this linear
        self.register_buffer("a", a, persistent=False)
        self.b = b
        self.native = native
        self.desc = (None if native is None else
                     native.describe(a, b, parts, sum(cols for _, cols in parts)))

    def warm_up(self) -> None:
        """Run the delta kernel once over a row of the base model (it adds nothing): on
        CUDA that compiles its Triton variants at start, not on a request's time."""
        if self.native is None:
            return
        x = torch.zeros(1, self.a.shape[2], dtype=self.a.dtype, device=self.a.device)
        y = torch.zeros(1, sum(cols for _, cols in self.parts), dtype=self.a.dtype,
                        device=self.a.device)
        self.native.add(self.desc, x, torch.full((1,), -1, device=self.a.device), y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (T, out)
        mask, row_slots = self.state.rows(self.head, self.adapted)
        if mask is None:
            return y
        if self.native is not None and self.desc is not None and x.dtype == y.dtype == \
                self.a.dtype:
            assert row_slots is not None  # set with the mask
            y = y.contiguous()
            self.native.add(self.desc, x.contiguous(), row_slots, y)
            return y
        if y.dtype != self.a.dtype:  # a head giving float32 logits: the delta in float32
            return y + self._delta(x.to(self.a.dtype), mask, torch.zeros_like(y, dtype=self.a.dtype)
                                   ).to(y.dtype)
        return self._delta(x, mask, y)

    def _delta(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's delta, in two matmuls over the slots in use."""
        T, n, rank = x.shape[0], mask.shape[1], self.b[0].shape[1]
        shrunk = x @ self.a[:n].reshape(n * self.a.shape[1], -1).t()  # (T, n P R)
        shrunk = shrunk.view(T, n, -1) * mask  # (T, n, P R)
        if len(self.parts) == 1:
            return torch.addmm(y, shrunk.view(T, -1), self.b[0][:n].reshape(n * rank, -1))
        by_part = shrunk.view(T, n, len(self.parts), rank)  # (T, n, P, R)
        for p, (first, cols) in enumerate(self.parts):
            y[:, first:first + cols].addmm_(by_part[:, :, p].reshape(T, n * rank),
                                            self.b[p][:n].reshape(n * rank, cols))
        return y


class LoRAEmbedding(nn.Module):
    """The token embedding `base` with the step's LoRA deltas: a token t of a row with slot s
    gets B_s A_s[:, t] added (PEFT's embedding LoRA). `a` (slots, R, vocab), `b[0]` (slots,
    R, hidden) scaled, as `slots.py` fills a LoRALinear's (vocab in, hidden out, one part).
    A row of the base model gets nothing added: its embedding is the base's, bit for bit."""

    a: torch.Tensor

    def __init__(self, base: nn.Module, a: torch.Tensor, b: list[torch.Tensor],
                 state: LoRAStepState) -> None:
        super().__init__()
        self.base, self.state, self.b = base, state, b
        self.parts = [(0, b[0].shape[2])]
        self.adapted: set[int] = set()
        self.register_buffer("a", a, persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # what reads the embedding's rows reads the base's
        return cast(torch.Tensor, self.base.weight)

    def warm_up(self) -> None:
        """Nothing to compile: the deltas are torch indexing and one batched matmul."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.base(ids)  # (T, h)
        mask, row_slots = self.state.rows(False, self.adapted)
        if mask is None or row_slots is None:
            return x
        T, n = ids.shape[0], mask.shape[1]
        shrunk = self.a[:n][:, :, ids].permute(2, 0, 1) * mask  # (T, n, R): each token's column
        delta = shrunk.reshape(T, -1).float() @ self.b[0][:n].reshape(-1, x.shape[1]).float()
        # the base rows keep their bits (no sync: the same on every device)
        return torch.where((row_slots >= 0).unsqueeze(1), (x.float() + delta).to(x.dtype), x)
