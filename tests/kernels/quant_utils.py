"""Helpers for the quantized-GEMM tests: random integer weights in the canonical form, and the
tolerance a bf16 / fp16 output is held to."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntWeight:
    codes: torch.Tensor  # uint8 (N, K)
    scales: torch.Tensor  # (N, G)
    zeros: torch.Tensor | None  # uint8 (N, G)
    g_idx: torch.Tensor | None  # int32 (K,)
    group_size: int
    bits: int


def make_int_weight(n: int, k: int, bits: int, group_size: int, *, asymmetric: bool,
                    act_order: bool, seed: int = 0, scale_dtype=torch.bfloat16) -> IntWeight:
    """Codes over the whole range; scales about 1 / (range x sqrt(K)) so outputs stay O(1);
    act-order: GPTQ's g_idx, ``k // group_size`` over a shuffled column order."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(n, groups, generator=gen) + 0.5) / ((1 << bits) * k ** 0.5)).to(
        scale_dtype)
    zeros = (torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.uint8)
             if asymmetric else None)
    g_idx = None
    if act_order:
        order = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    return IntWeight(codes, scales, zeros, g_idx, group_size, bits)


def assert_gemm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding: 2^-7 of each element plus 2^-8 of the largest (a weight tile
    rounded to bf16 before its dot, sums in another order, one output rounding)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype)
    got, want = got.float().cpu(), want.float().cpu()
    assert torch.isfinite(got).all(), "non-finite output"
    bound = want.abs() * 2 ** -7 + want.abs().max() * 2 ** -8
    worst = ((got - want).abs() - bound).max()
    assert worst <= 0, f"off by up to {worst:.3g} beyond the bound"
