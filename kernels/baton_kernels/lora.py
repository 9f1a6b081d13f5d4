"""LoRA deltas on the GPU, each row its own adapter (or none): `lora_add` adds
(A_s[p R:(p + 1) R] x[m]) @ B_{p,s} onto part p's columns of y[m] for s = row_slots[m] >= 0,
as `baton_cpu`'s `csrc/lora_bf16.c` does on CPU (float32 between the two products, one
rounding of each output element). Two kernels: the shrink, one program per (row, block of
A's rows) reducing over the input; the expand, one program per (row, block of a part's
columns). Rows of the base model (slot < 0) do nothing. The reference is
`baton_cpu.reference.lora_add` (the tests hold both kernels to it).

Variants: the row count is not specialised, nor the row-slot pointer's alignment; the rest
(ranks, widths, dtypes) is the model's and the engine's `--max-lora-rank`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels._common import check_same_device, next_pow2
from baton_kernels._tiles import loop_bound
from baton_kernels._variants import jit

BLOCK_K, BLOCK_N = 64, 64


@jit(dynamic=("num_rows",), unaligned=("slot_ptr",))
def lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, t_ptr, num_rows, in_features, stride_x,
                       stride_as, stride_t, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """t[m, r] = A_s[r] . x[m] for the BLOCK_R rows r of this program (float32)."""
    m = tl.program_id(0)
    s = tl.load(slot_ptr + m).to(tl.int64)
    if s >= 0:
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < ROWS
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, loop_bound(in_features), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < in_features
            x = tl.load(x_ptr + m * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + offs_r[:, None] * in_features + offs_k[None, :],
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(t_ptr + m * stride_t + offs_r, acc, mask=r_mask)


@jit(dynamic=("num_rows",), unaligned=("slot_ptr",))
def lora_expand_kernel(t_ptr, b_ptr, slot_ptr, y_ptr, num_rows, cols, first, t_offset,
                       stride_t, stride_bs, stride_y, RANK: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[m, first + n] += sum_r t[m, t_offset + r] B_s[r, n] over this program's columns."""
    m = tl.program_id(0)
    s = tl.load(slot_ptr + m).to(tl.int64)
    if s >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < cols
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        t = tl.load(t_ptr + m * stride_t + t_offset + offs_r, mask=r_mask, other=0.0)
        b = tl.load(b_ptr + s * stride_bs + offs_r[:, None] * cols + offs_n[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(t[:, None] * b, axis=0)  # (BLOCK_N,)
        y_at = y_ptr + m * stride_y + first + offs_n
        y = tl.load(y_at, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_at, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def lora_add(x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor, a: torch.Tensor,
             b: list[torch.Tensor], parts: list[tuple[int, int]]) -> None:
    """y (M, out) += each row's adapter's delta of x (M, in), in place. a (slots, P R, in),
    b[p] (slots, R, cols_p) contiguous; row_slots (M,) int64 (-1: none); parts[p] =
    (first column, columns). ValueError for shapes that do not fit."""
    check_same_device(x.device, y=y, row_slots=row_slots, a=a)
    M, K = x.shape
    rows, rank = a.shape[1], b[0].shape[1]
    if (a.shape[2] != K or y.shape[0] != M or row_slots.shape != (M,) or len(b) != len(parts)
            or rows != len(parts) * rank or not a.is_contiguous()
            or not all(t.is_contiguous() and t.shape[1] == rank for t in b)):
        raise ValueError(f"lora_add: x {tuple(x.shape)}, y {tuple(y.shape)}, a "
                         f"{tuple(a.shape)}, b {[tuple(t.shape) for t in b]} do not fit")
    if M == 0:
        return
    t = torch.empty(M, rows, dtype=torch.float32, device=x.device)  # (M, P R)
    block_r = min(next_pow2(rows), 64)
    lora_shrink_kernel[(M, triton.cdiv(rows, block_r))](
        x, a, row_slots, t, M, K, x.stride(0), a.stride(0), t.stride(0),
        ROWS=rows, BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    for p, ((first, cols), part) in enumerate(zip(parts, b)):
        lora_expand_kernel[(M, triton.cdiv(cols, BLOCK_N))](
            t, part, row_slots, y, M, cols, first, p * rank, t.stride(0), part.stride(0),
            y.stride(0), RANK=rank, BLOCK_R=next_pow2(rank), BLOCK_N=BLOCK_N)


class TritonLoRA:
    """`LoRALinear`'s delta kernel on CUDA, with `baton_cpu.lora.NativeLoRA`'s shape: a
    linear's buffers described once, `add` per forward."""

    @staticmethod
    def describe(a: torch.Tensor, b: list[torch.Tensor], parts: list[tuple[int, int]],
                 out_features: int) -> tuple[torch.Tensor, list[torch.Tensor],
                                             list[tuple[int, int]]]:
        return a, b, parts

    @staticmethod
    def add(desc: tuple[torch.Tensor, list[torch.Tensor], list[tuple[int, int]]],
            x: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor) -> None:
        a, b, parts = desc
        lora_add(x, y, row_slots, a, b, parts)
