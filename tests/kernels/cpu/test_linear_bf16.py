"""The bf16 linear paths on CPU: the native packed GEMM (AVX512-BF16), the portable GEMV and
oneDNN's packed GEMM against a float32 reference, with and without bias, at the row counts and
shapes each one serves, and PackedLinear's choice between them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from baton_cpu.linear import PackedLinear, can_pack, onednn_bf16_supported
from baton_cpu.reference import linear as reference

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN is not available in this torch build")


@pytest.fixture(scope="module")
def native(native_linear):
    return native_linear


@pytest.fixture(scope="module")
def vnni(native):
    if not native.has_vnni:
        pytest.skip("this CPU has no AVX512-BF16: the packed GEMM is not built")
    return native



def assert_close_to_reference(y, ref):
    # bf16 output: at most half an ulp of rounding on top of fp32 summation-order noise.
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-2).all()


def test_vnni_availability_matches_the_cpu(native):
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert native.has_vnni == (re.search(r"\bavx512_bf16\b", flags) is not None)
    assert native.gemv_max_rows == 2


# Rows: partial and whole 6-row tiles, a decode batch, a prefill chunk. Outputs: 1-4 column
# blocks of 16 in the last tile. K: one pair, odd pair counts, the model's widths.
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 301])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 30), (80, 576), (960, 576), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_gemm_matches_reference(vnni, rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = vnni.pack(w)
    assert packed is not None and packed.numel() == w.numel()  # no extra memory
    assert_close_to_reference(vnni.gemm(x, packed, b, n), reference(x, w, b))


def test_packed_gemm_rounds_like_torch(vnni):
    """Exact sums (small integers) land on bf16 ties and beyond: rounding to nearest even,
    as torch's bf16 conversion does, and inf passes through."""
    k = 64
    sums = [(256.0, 2.0), (256.0, 3.0), (256.0, 5.0), (3e38, 3e38)]
    x = torch.zeros(len(sums), k, dtype=torch.bfloat16)
    for i, pair in enumerate(sums):
        x[i, :2] = torch.tensor(pair)
    w = torch.zeros(16, k, dtype=torch.bfloat16)
    w[:, :2] = 1.0
    y = vnni.gemm(x, vnni.pack(w), None, 16)
    # 258 exact; 259 and 261 are ties: to 260 both (truncation gives 258, half-up 262).
    expected = torch.tensor([258.0, 260.0, 260.0, float("inf")]).bfloat16()
    assert torch.equal(y[:, 0], expected)


def test_pack_refuses_shapes_the_gemm_cannot_serve(vnni):
    assert vnni.pack(torch.randn(24, 32).bfloat16()) is None  # N not a multiple of 16
    assert vnni.pack(torch.randn(32, 33).bfloat16()) is None  # K odd
    assert vnni.pack(torch.randn(32, 32)) is None  # not bf16
    with pytest.raises(RuntimeError, match="GEMM failed"):
        vnni.gemm(torch.randn(2, 33).bfloat16(), torch.empty(32 * 33).bfloat16(), None, 32)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k", [576, 577])
def test_portable_gemv_matches_reference(native, rows, with_bias, k):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(301, k, generator=g).bfloat16()  # odd N: no row is left out
    b = torch.randn(301, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, k, generator=g).bfloat16()
    assert_close_to_reference(native.gemv(x, w, b), reference(x, w, b))
    with pytest.raises(RuntimeError, match="GEMV failed"):
        native.gemv(torch.randn(3, k).bfloat16(), w, None)


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
def test_packed_linear_forms_agree(native, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 128, generator=g).bfloat16()
    with_native, plain = PackedLinear(w, b, native), PackedLinear(w, b)
    if onednn_bf16_supported():
        assert plain.weight is None and plain.vnni is None  # oneDNN's copy only
    else:  # no bf16 in oneDNN on this CPU: the row-major weight alone
        assert plain.packed is None and plain.vnni is None and plain.weight is not None
    if native.has_vnni:  # the packed GEMM serves every batch from the only copy
        assert with_native.packed is None and with_native.weight is None
        assert torch.equal(with_native(x), native.gemm(x, with_native.vnni, b, 96))
        assert torch.equal(with_native(x.view(1, rows, 128)), with_native(x).view(1, rows, 96))
    elif rows <= native.gemv_max_rows:
        assert torch.equal(with_native(x), native.gemv(x, w, b))
    ref = reference(x, w, b)
    for layer in (with_native, plain):
        y = layer(x).float()
        assert ((y - ref).abs() <= ref.abs() * 2 ** -7 + 2e-2).all()


def test_unpackable_shapes_keep_onednn(native):
    w = torch.randn(24, 32).bfloat16()  # 24 outputs: not a whole 16-column block
    layer = PackedLinear(w, None, native)
    assert layer.vnni is None and (layer.packed is not None) == onednn_bf16_supported()
    x = torch.randn(9, 32).bfloat16()
    assert_close_to_reference(layer(x), reference(x, w, None))
