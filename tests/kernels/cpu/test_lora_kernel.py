"""`baton_cpu.lora`'s kernel against its float32 reference: every row its own adapter or
none, fused linears' parts on their own columns, ranks and widths that do not fill a vector."""

from __future__ import annotations

import pytest
import torch

from baton_cpu import lora, reference


@pytest.fixture(scope="module")
def native_lora(kernel_cache):
    kernel = lora.load_lora_kernel(kernel_cache)
    if kernel is None:
        pytest.skip("no C compiler: the LoRA kernel cannot be built here")
    return kernel


@pytest.mark.parametrize("parts,rank,k", [
    ([(0, 64)], 8, 64),  # one part
    ([(0, 96), (96, 32), (128, 32)], 16, 80),  # q / k / v
    ([(0, 50), (50, 50)], 3, 37),  # gate / up, odd sizes
])
def test_matches_the_reference(native_lora, parts, rank, k):
    g = torch.Generator().manual_seed(rank)
    slots, m = 3, 11
    out = parts[-1][0] + parts[-1][1]
    a = torch.randn(slots, len(parts) * rank, k, generator=g).bfloat16()
    b = [torch.randn(slots, rank, cols, generator=g).bfloat16() for _, cols in parts]
    x = torch.randn(m, k, generator=g).bfloat16()
    y = torch.randn(m, out, generator=g).bfloat16()
    row_slots = torch.tensor([-1, 0, 2, 1, -1, 2, 2, 0, 1, -1, 0])
    want = reference.lora_add(x, y, row_slots, a, b, parts)
    got = y.clone()
    native_lora.add(native_lora.describe(a, b, parts, out), x, row_slots, got)
    assert torch.equal(got[row_slots < 0], y[row_slots < 0])  # base rows untouched
    # float32 sums in another order, one bf16 rounding: at most one bf16 step apart
    ulp = want.float().abs().clamp_min(1e-3) * 2 ** -7
    assert ((got.float() - want.float()).abs() <= ulp).all()


def test_refuses_buffers_it_cannot_take(native_lora):
    a = torch.zeros(1, 4, 8)  # float32
    with pytest.raises(ValueError, match="contiguous bf16"):
        native_lora.describe(a, [torch.zeros(1, 4, 8).bfloat16()], [(0, 8)], 8)


def test_a_rows_delta_does_not_depend_on_the_batch(native_lora):
    """Rows of one adapter run in blocks, the rest alone: a row's bits are the same either way
    (a request's tokens never depend on what else is in its step)."""
    g = torch.Generator().manual_seed(7)
    parts, rank, k = [(0, 96), (96, 40)], 8, 100  # a vector tail in both products
    a = torch.randn(2, 2 * rank, k, generator=g).bfloat16()
    b = [torch.randn(2, rank, cols, generator=g).bfloat16() for _, cols in parts]
    desc = native_lora.describe(a, b, parts, 136)
    x = torch.randn(9, k, generator=g).bfloat16()
    y = torch.randn(9, 136, generator=g).bfloat16()
    row_slots = torch.tensor([0, 0, 1, 0, 0, 0, -1, 1, 0])  # a block of 4, then a remainder
    batch = y.clone()
    native_lora.add(desc, x, row_slots, batch)
    for m in range(9):
        alone = y[m:m + 1].clone()
        native_lora.add(desc, x[m:m + 1].contiguous(), row_slots[m:m + 1].contiguous(), alone)
        assert torch.equal(alone[0], batch[m]), m
