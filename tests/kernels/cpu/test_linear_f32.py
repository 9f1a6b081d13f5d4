"""The float32 small-batch GEMV on CPU (`csrc/linear_f32.c`) against a float64 reference at
every row count it serves and shapes that leave every tail (outputs not a multiple of its
tiles, K not a multiple of 8); SmallBatchLinear's choice between it and F.linear; and a model
in float32 serving through it without copying a weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton_cpu.linear import SmallBatchLinear, can_pack, pack_linears


def reference(x, w, b):
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("rows", [*range(1, 9), 11, 13, 23, 24])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (13, 8), (26, 45), (960, 576), (577, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_reference(gemv_f32, rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 31 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    y = gemv_f32(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # fp32 sums in another order than the reference's: a few ulps of the row's magnitude
    scale = (x.abs().double() @ w.abs().double().T) * 2 ** -20 + 1e-6
    assert ((y.double() - reference(x, w, b)).abs() <= scale).all()


def test_gemv_serves_up_to_24_rows_and_refuses_more(gemv_f32):
    assert gemv_f32.max_rows == 24
    with pytest.raises(RuntimeError, match=r"fp32 GEMV failed \(code -1\)"):
        gemv_f32(torch.zeros(25, 4), torch.zeros(3, 4), None)


def test_small_batch_linear_routes_by_rows(gemv_f32):
    g = torch.Generator().manual_seed(0)
    base = nn.Linear(64, 40)
    with torch.no_grad():
        base.weight.copy_(torch.randn(40, 64, generator=g))
    linear = SmallBatchLinear(base.weight, base.bias, gemv_f32)
    assert linear.weight.data_ptr() == base.weight.data_ptr()  # torch's own weight, no copy
    for rows in (1, 8, 13, 24, 25, 64):
        x = torch.randn(rows, 64, generator=g)
        torch.testing.assert_close(linear(x), base(x), rtol=1e-5, atol=1e-5)
    # above max_rows, and any batch of another rank, is F.linear exactly
    x = torch.randn(gemv_f32.max_rows + 1, 64, generator=g)
    assert torch.equal(linear(x), nn.functional.linear(x, base.weight, base.bias))
    x3 = torch.randn(2, 3, 64, generator=g)
    assert torch.equal(linear(x3), nn.functional.linear(x3, base.weight, base.bias))
    assert linear(torch.randn(0, 64)).shape == (0, 40)


def test_pack_linears_swaps_float32_linears_only(gemv_f32):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    weights = [model[0].weight.data_ptr(), model[2][0].weight.data_ptr()]
    pack_linears(model, None, gemv_f32)
    assert isinstance(model[0], SmallBatchLinear) and isinstance(model[2][0], SmallBatchLinear)
    assert [model[0].weight.data_ptr(), model[2][0].weight.data_ptr()] == weights
    untouched = nn.Sequential(nn.Linear(8, 16))
    pack_linears(untouched, None, None)  # no GEMV built here: torch's linear stays
    assert type(untouched[0]) is nn.Linear
    assert can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.float32, torch.device("meta"))
