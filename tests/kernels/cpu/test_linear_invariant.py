"""The batch-invariant GEMM (`csrc/linear_invariant.c`) and deterministic mode's linears:
close to a float reference, and every output row the same bits whatever rows it was computed
with (alone, in any slice, at any row count) — in bf16 and fp32, on shapes with every kind of
tail. The AVX2 build, the scalar build (a CPU without AVX2) and this CPU's own build follow one
summation order, so they agree bit for bit. Where the CPU has AVX512-BF16 the packed VNNI GEMM
serves bf16 in deterministic mode: it is held to the same invariance."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton_cpu import linear
from baton_cpu.build import load_library

SHAPES = [(576, 576), (37, 101), (5, 9), (130, 8)]  # (N, K): tails in N, K and strips
SLICES = [(0, 1), (5, 6), (3, 10), (10, 67), (1, 3), (20, 25), (0, 67), (66, 67)]


@pytest.fixture(scope="module")
def gemm(kernel_cache):
    g = linear.load_invariant_gemm(kernel_cache)
    if g is None:
        pytest.skip("no C compiler: the batch-invariant GEMM cannot be built here")
    return g


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(67, k, generator=gen).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference(gemm, dtype, n, k):
    x, w, b = _weights(n, k, dtype)
    ref = nn.functional.linear(x.double(), w.double(), b.double())
    got = gemm(x, w, b).double()
    # bf16: one rounding of the output (2^-8 relative) on top of fp32 sums
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got, ref, rtol=tol, atol=tol * k ** 0.5)
    assert torch.equal(gemm(x, w, None), gemm(x, w, torch.zeros_like(b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_do_not_depend_on_the_batch(gemm, dtype, n, k):
    x, w, b = _weights(n, k, dtype, seed=1)
    full = gemm(x, w, b)  # (67, n)
    for i, j in SLICES:
        assert torch.equal(gemm(x[i:j].clone(), w, b), full[i:j]), (i, j)
    shuffled = torch.randperm(67, generator=torch.Generator().manual_seed(2))
    assert torch.equal(gemm(x[shuffled], w, b), full[shuffled])


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_avx2_and_scalar_builds_sum_in_the_same_order(gemm, kernel_cache, march):
    if march == "x86-64-v3" and not gemm.vectorised:
        pytest.skip("this CPU runs no AVX2 build")
    lib = load_library("linear_invariant.c", kernel_cache,
                       ("-fno-associative-math", f"-march={march}"))
    assert lib is not None
    other = linear.InvariantGemm(lib)
    assert other.vectorised == (march == "x86-64-v3")
    for dtype in (torch.bfloat16, torch.float32):
        x, w, b = _weights(37, 101, dtype, seed=3)
        assert torch.equal(other(x, w, b), gemm(x, w, b)), dtype


def test_deterministic_linears_replace_every_linear(gemm, kernel_cache):
    model = nn.Sequential(nn.Linear(64, 32), nn.Sequential(nn.Linear(32, 48, bias=False)))
    model = model.to(torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    native = linear.load_linear_kernels(kernel_cache)
    linear.use_invariant_linears(model, gemm, native)
    kinds = {type(m) for m in model.modules()} - {nn.Sequential}
    assert nn.Linear not in kinds
    assert kinds <= {linear.InvariantLinear, linear.PackedLinear}
    full = model(x)
    assert all(torch.equal(model(x[i:i + 1]), full[i:i + 1]) for i in range(9))
    with pytest.raises(ValueError, match="float16"):
        linear.use_invariant_linears(nn.Sequential(nn.Linear(8, 8)).half(), gemm)


def test_vnni_gemm_rows_do_not_depend_on_the_batch(kernel_cache):
    native = linear.load_linear_kernels(kernel_cache)
    if native is None or not native.has_vnni:
        pytest.skip("no AVX512-BF16 here: deterministic mode uses the invariant GEMM only")
    for n, k in [(576, 576), (1536, 576), (576, 1536), (32, 18)]:
        x, w, _ = _weights(n, k, torch.bfloat16, seed=4)
        packed = native.pack(w)
        full = native.gemm(x, packed, None, n)
        for i, j in SLICES:
            assert torch.equal(native.gemm(x[i:j].clone(), packed, None, n), full[i:j])
