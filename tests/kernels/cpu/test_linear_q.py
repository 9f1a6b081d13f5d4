"""The GGUF block-quantized linear (`csrc/linear_q.c`, `csrc/linear_qk.h`) against its torch
reference: weights quantized with the formats' own published math (the `gguf` package's numpy
quantizers, as llama.cpp writes them; for Q4_K and Q6_K, which the package cannot quantize,
`quant_reference.quantize_k`, checked here against the package's de-quantizers), every path
the kernel has (AVX-512 VNNI, 256-bit VNNI, AVX2, scalar; those this CPU can run), odd shapes
and tails (N not a multiple of 8, rows past the 4-row tile), with bias, and fused linears
whose parts differ in type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton_cpu.quant_linear import QuantLinear, load_quant_kernels
from baton_cpu.quant_reference import QuantType, dequantize, quantize_k, reference_linear

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402  (after the skip)

SOURCES = ("linear_q.c", "linear_q_vnni256.c", "linear_q_avx2.c", "linear_q_scalar.c")
K_TYPES = (QuantType.Q4_K, QuantType.Q6_K)
BLOCK_TYPES = [t for t in QuantType if t not in K_TYPES]


@pytest.fixture(scope="module", params=SOURCES)
def kernels(request, kernel_cache):
    native = load_quant_kernels(kernel_cache, request.param)
    if native is None:
        pytest.skip(f"no C compiler: {request.param} cannot be built here")
    return native


def quantized(n: int, k: int, qtype: QuantType, seed: int = 0) -> torch.Tensor:
    """Random weights (n, k) as GGUF's raw blocks, uint8 (n, k / 32 * block bytes)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if qtype in K_TYPES:
        return quantize_k(torch.from_numpy(w), qtype)
    raw = gguf_quants.quantize(w, GGMLQuantizationType(int(qtype)))
    return torch.from_numpy(np.ascontiguousarray(raw))


@pytest.mark.parametrize("qtype", list(QuantType))
def test_dequantize_matches_gguf(qtype):
    raw = quantized(24, 512, qtype)
    ours = dequantize(raw, qtype, 512)
    theirs = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType(int(qtype)))
    assert torch.equal(ours, torch.from_numpy(theirs.reshape(24, 512)))


@pytest.mark.parametrize(("qtype", "tolerance"), [(QuantType.Q4_K, 0.1), (QuantType.Q6_K, 0.025)])
def test_k_quantizer_round_trips(qtype, tolerance):
    """quantize_k writes blocks the gguf package reads back close to the weights (relative
    error of a 4- and a 6-bit format over normal weights), with no scale wasted."""
    w = torch.randn(16, 768) * 0.05
    w[3, :256] = 0  # an all-zero super-block quantizes to zeros
    back = dequantize(quantize_k(w, qtype), qtype, 768)
    assert (back - w).norm() <= tolerance * w.norm()
    assert torch.equal(back[3, :256], torch.zeros(256))


SHAPES = [(1, 64, 576), (3, 13, 32), (5, 40, 96), (9, 24, 160), (32, 96, 64)]
K_SHAPES = [(1, 64, 512), (3, 13, 256), (5, 40, 768), (9, 24, 256), (32, 96, 512)]


@pytest.mark.parametrize(("qtype", "m", "n", "k"),
                         [(t, *s) for t in BLOCK_TYPES for s in SHAPES]
                         + [(t, *s) for t in K_TYPES for s in K_SHAPES])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_reference(kernels, qtype, m, n, k, bias):
    torch.manual_seed(m * n + k)
    raw = quantized(n, k, qtype, seed=n + k)
    x = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    layer = QuantLinear(raw, qtype, k, b, kernels)
    layer.set_dequant_rows(0)  # every batch through the int8 path (the bf16 one: below)
    y = layer(x)
    ref = reference_linear(x, raw, qtype, b)  # same int8 activations, fp32 sums
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # bf16 output (half an ulp) on top of fp32 summation-order noise.
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all()
    # and the int8 activations cost little against the float product
    exact = reference_linear(x, raw, qtype, b, quantized_x=False)
    assert (y.float() - exact).norm() <= 0.02 * exact.norm()


def test_any_leading_shape_and_zero_rows(kernels):
    raw = quantized(16, 64, QuantType.Q4_1)
    layer = QuantLinear(raw, QuantType.Q4_1, 64, None, kernels)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), layer(x.reshape(6, 64)).view(2, 3, 16))
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 16)


def test_bad_shapes_are_refused(kernels):
    raw = quantized(8, 64, QuantType.Q8_0)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantLinear(raw, QuantType.Q8_0, 48, None, kernels)
    layer = QuantLinear(raw, QuantType.Q8_0, 64, None, kernels)
    with pytest.raises(TypeError, match="bfloat16"):
        layer(torch.randn(1, 64))


def test_zero_activations_give_the_bias(kernels):
    raw = quantized(8, 64, QuantType.Q4_0)
    b = torch.arange(8).to(torch.bfloat16)
    y = QuantLinear(raw, QuantType.Q4_0, 64, b, kernels)(torch.zeros(2, 64,
                                                                      dtype=torch.bfloat16))
    assert torch.equal(y, b.expand(2, 8))


@pytest.mark.parametrize("m", [1, 6, 11])
def test_fused_parts_of_different_types(kernels, m):
    """A Q4_K_M-style qkv: q and k in Q4_K, v in Q6_K (13 rows: a group's tail), then a
    Q8_0 part; the output is each part's rows in order."""
    k = 512
    parts = [(quantized(32, k, QuantType.Q4_K, 1), QuantType.Q4_K),
             (quantized(16, k, QuantType.Q4_K, 2), QuantType.Q4_K),
             (quantized(13, k, QuantType.Q6_K, 3), QuantType.Q6_K),
             (quantized(8, k, QuantType.Q8_0, 4), QuantType.Q8_0)]
    b = torch.randn(69).to(torch.bfloat16)
    layer = QuantLinear.fused(parts, k, b, kernels)
    layer.set_dequant_rows(0)
    assert layer.type_names == "Q4_K+Q6_K+Q8_0" and layer.out_features == 69
    x = torch.randn(m, k).to(torch.bfloat16)
    ref = torch.cat([reference_linear(x, raw, t) for raw, t in parts], dim=1) + b.float()
    y = layer(x)
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3).all()


def test_k_types_need_whole_super_blocks(kernels):
    raw = quantized(8, 256, QuantType.Q4_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantLinear(raw[:, :72], QuantType.Q4_K, 128, None, kernels)


@pytest.mark.parametrize("qtype", list(QuantType))
@pytest.mark.parametrize("m", [16, 45])
def test_prefill_rows_equal_the_bf16_gemm_of_the_dequantized_weight(kernel_cache, qtype, m):
    """From dequant_rows rows on (AVX512-BF16 CPUs), the whole groups of rows are the bf16
    GEMM over the weight de-quantized as the gguf package does, bit for bit (the model
    loaded with --quantization none computes the same); a tail of rows past the last whole
    group (8 of 72) takes the int8 path."""
    from baton_cpu.linear import PackedLinear, load_linear_kernels

    native, bf16 = load_quant_kernels(kernel_cache), load_linear_kernels(kernel_cache)
    if native is None or not native.dequant_rows or bf16 is None or not bf16.has_vnni:
        pytest.skip("no AVX512-BF16 here: every batch takes the int8 path")
    assert m >= native.dequant_rows
    k = 512
    raw = quantized(72, k, qtype, seed=m)
    b = torch.randn(72).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = QuantLinear(raw, qtype, k, b, native)(x)
    w = torch.from_numpy(gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType(int(qtype))))
    gemm = PackedLinear(w.reshape(72, k).to(torch.bfloat16)[:64], b[:64], bf16)
    assert gemm.vnni is not None and torch.equal(y[:, :64], gemm(x))
    ref = reference_linear(x, raw, qtype, b)
    assert ((y[:, 64:].float() - ref[:, 64:]).abs() <= ref[:, 64:].abs() * 2 ** -8 + 1e-3).all()
