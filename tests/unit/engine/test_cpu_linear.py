"""The bf16 linear paths on CPU: the native small-batch GEMV and oneDNN's packed GEMM
against a float32 reference, with and without bias, at the row counts each one serves."""

from __future__ import annotations

import pytest
import torch

from baton.engine.models.cpu_packing import PackedLinear, can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN is not available in this torch build")


@pytest.fixture(scope="module")
def gemv(native_gemv):
    return native_gemv


def reference(x, w, b):
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [576, 577])  # 577: a partial 32-element step at the end
def test_gemv_matches_reference(gemv, rows, with_bias, k):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(301, k, generator=g).bfloat16()  # odd N: no row is left out
    b = torch.randn(301, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    y = gemv(x, w, b)
    ref = reference(x, w, b)
    # bf16 output: at most half an ulp of rounding on top of fp32 summation-order noise.
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 301)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-2).all()


def test_gemv_rejects_too_many_rows(gemv):
    w = torch.randn(16, 32).bfloat16()
    with pytest.raises(RuntimeError, match="GEMV failed"):
        gemv(torch.randn(9, 32).bfloat16(), w, None)


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_packed_linear_paths_agree(gemv, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 128, generator=g).bfloat16()
    with_gemv, plain = PackedLinear(w, b, gemv), PackedLinear(w, b)
    assert plain.weight is None  # no second copy of the weight without the GEMV
    ref = reference(x, w, b)
    for layer in (with_gemv, plain):
        y = layer(x).float()
        assert ((y - ref).abs() <= ref.abs() * 2 ** -7 + 2e-2).all()
    if rows <= gemv.max_rows:  # small batches take the GEMV, bit for bit
        assert torch.equal(with_gemv(x), gemv(x, w, b))


def test_gemv_row_limit_matches_the_cpu(gemv):
    """8 rows where the build has vdpbf16ps (AVX512-BF16), 2 on the portable path."""
    import re
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has_bf16 = re.search(r"\bavx512_bf16\b", flags) is not None
    assert gemv.max_rows == (8 if has_bf16 else 2)
