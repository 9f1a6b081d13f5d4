"""The quantized-weight GEMMs on the device at Llama-3-8B's shapes (K 4096 and 14336, N 6144)
against their float32 references (kernels/baton_kernels/quant_reference.py), at decode and
prefill row counts: the buckets, split-K and the paths the device's capability picks, which
tests/kernels runs at small sizes only."""

from __future__ import annotations

import pytest
import torch

from baton_kernels import fp8_weight_gemm, int_weight_gemm
from baton_kernels.quant_pack import group_major, pack_int_weight
from baton_kernels.quant_reference import fp8_weight_gemm_ref, int_weight_gemm_ref
from tests.kernels.quant_utils import assert_gemm_close, make_int_weight

ROWS = (1, 16, 300)


@pytest.mark.parametrize("n,k,bits,group_size,act_order", [
    (6144, 4096, 4, 128, False), (4096, 14336, 4, 128, True), (6144, 4096, 8, 4096, False)])
def test_int_weights_at_8b_shapes(cuda, n, k, bits, group_size, act_order):
    weight = make_int_weight(n, k, bits, group_size, asymmetric=bits == 4,
                             act_order=act_order)
    packed = pack_int_weight(weight.codes, bits).to(cuda)
    scales = group_major(weight.scales).to(cuda)
    zeros = group_major(weight.zeros).to(cuda) if weight.zeros is not None else None
    g_idx = weight.g_idx.to(cuda) if weight.g_idx is not None else None
    gen = torch.Generator().manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        got = int_weight_gemm(x.to(cuda), packed, scales, zeros, g_idx, group_size, bits, n, k)
        assert got.is_cuda
        want = int_weight_gemm_ref(x, weight.codes, weight.scales, weight.zeros, weight.g_idx,
                                   group_size, bits)
        assert_gemm_close(got, want)


@pytest.mark.parametrize("scheme,static", [("channel", False), ("tensor", True),
                                           ("block", False)])
def test_fp8_weights_at_8b_shapes(cuda, scheme, static):
    n, k = 6144, 4096
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    block = (128, 128) if scheme == "block" else None
    shape = {"tensor": (1,), "channel": (n,), "block": (n // 128, k // 128)}[scheme]
    w_scale = (torch.rand(shape, generator=gen) + 0.5) / (40 * k ** 0.5)
    input_scale = torch.tensor([0.02]) if static else None
    # imported here, not at collection: it decorates Triton kernels, which must wait until
    # tests/kernels has set the interpreter (a whole-tree run collects this file first)
    from baton_kernels.fp8_gemm import fp8_path

    path = fp8_path(torch.cuda.get_device_capability(), n, k, block)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        got = fp8_weight_gemm(x.to(cuda), w.to(cuda), w_scale.to(cuda), block,
                              input_scale.to(cuda) if static else None)
        want = fp8_weight_gemm_ref(x, w, w_scale, block, input_scale,
                                   quantize_activations=path != "w8a16")
        assert_gemm_close(got, want)
