"""FP8-weight GEMMs (`baton_kernels.fp8_gemm`) against the float32 reference
(`quant_reference`): the activation quantization (per token, per token-group, static), and
every path of `fp8_weight_gemm` as a device of each compute capability takes it — W8A16 (sm_80),
the Triton W8A8 block-wise GEMM and ``torch._scaled_mm`` (sm_89+) — with per-tensor,
per-channel and 128x128 block scales, static and dynamic activation scales. The interpreter
runs FP8 loads and dots (the kernels read FP8 as bytes: it cannot fill masked FP8 loads), and
CPU torch runs ``_scaled_mm``; on CUDA, the capabilities the device has."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU
from tests.kernels.quant_utils import assert_gemm_close

pytest.importorskip("triton")

from baton_kernels.fp8_gemm import (  # noqa: E402
    fp8_gemm_for,
    fp8_path,
    fp8_weight_gemm,
    quantize_fp8_activations,
)
from baton_kernels.quant_reference import (  # noqa: E402
    fp8_weight_gemm_ref,
    quantize_fp8_activations_ref,
)

SM80, SM90 = (8, 0), (9, 0)
if ON_GPU:
    _CAP = torch.cuda.get_device_capability()
    CAPABILITIES = [SM80] + ([_CAP] if _CAP >= (8, 9) else [])
else:
    CAPABILITIES = [SM80, SM90]
STATIC = torch.tensor([0.03])


def make_fp8_weight(n: int, k: int, scheme: str, seed: int = 0):
    """(w e4m3 [N, K], w_scale, block) of one scale scheme."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    block = (128, 128) if scheme == "block" else None
    shape = {"tensor": (1,), "channel": (n,), "block": (-(-n // 128), -(-k // 128))}[scheme]
    scale = (torch.rand(shape, generator=gen) + 0.5) / (40 * k ** 0.5)
    return w, scale, block


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("static", [False, True])
def test_activation_quant_matches_the_reference(device, group, static):
    """Values equal the reference's (saturation at 448, ties to even, a zero row)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 300, generator=gen) * 3).to(torch.bfloat16)
    x[0, :4] = torch.tensor([1e3, -1e-3, 0.0, 447.9])
    x[1] = 0.0
    scale = STATIC if static else None
    q, s = quantize_fp8_activations(x.to(device), scale.to(device) if static else None, group)
    want_q, want_s = quantize_fp8_activations_ref(x, scale, group)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.equal(q.cpu().float(), want_q.float())  # -0.0 may read 0.0
    assert torch.equal(s.cpu().expand_as(want_s), want_s)
    assert q.float().abs().max() == 448.0


CASES = [  # m, n, k, scale scheme, static input scale, activation dtype
    (1, 64, 256, "tensor", True, torch.bfloat16),   # _scaled_mm tensor-wise on sm_89+
    (7, 96, 128, "channel", False, torch.float16),   # row-wise, bf16 output cast back
    (3, 48, 144, "tensor", False, torch.bfloat16),   # row-wise, dynamic per token
    (5, 100, 264, "channel", True, torch.bfloat16),  # N, K off 16: W8A16 everywhere
    (1, 130, 200, "block", False, torch.bfloat16),   # block-wise, partial blocks
    (33, 256, 384, "block", False, torch.float16),
    (2, 72, 136, "block", True, torch.bfloat16),     # block-wise with a static scale
]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("m,n,k,scheme,static,dtype", CASES)
def test_each_path_matches_the_reference(device, capability, m, n, k, scheme, static, dtype):
    w, scale, block = make_fp8_weight(n, k, scheme, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    input_scale = STATIC if static else None
    path = fp8_path(capability, n, k, block)
    got = fp8_gemm_for(capability, x.to(device), w.to(device), scale.to(device), block,
                       input_scale.to(device) if static else None)
    want = fp8_weight_gemm_ref(x, w, scale, block, input_scale,
                               quantize_activations=path != "w8a16")
    assert_gemm_close(got.cpu(), want)
    if path != "w8a16":  # quantizing the activations is visible: the W8A16 answer differs
        plain = fp8_weight_gemm_ref(x, w, scale, block, input_scale, False)
        assert not torch.equal(want, plain)


def test_paths_by_capability():
    assert fp8_path((8, 0), 64, 64, None) == "w8a16"
    assert fp8_path((8, 6), 64, 64, (128, 128)) == "w8a16"  # no FP8 dots before sm_89
    assert fp8_path((8, 9), 64, 64, None) == "scaled_mm"
    assert fp8_path((9, 0), 64, 64, (128, 128)) == "w8a8_block"
    assert fp8_path((9, 0), 72, 64, None) == "w8a16"  # _scaled_mm needs N, K % 16 == 0
    assert fp8_path((10, 0), 64, 72, None) == "w8a16"


def test_refuses_cpu_tensors_with_the_reason():
    w, scale, block = make_fp8_weight(64, 128, "channel")
    with pytest.raises(RuntimeError, match="runs on CUDA only.*de-quantize"):
        fp8_weight_gemm(torch.zeros(1, 128, dtype=torch.bfloat16), w, scale, block)


def test_refuses_scales_that_fit_no_scheme(device):
    w, _, _ = make_fp8_weight(64, 128, "channel")
    x = torch.zeros(1, 128, dtype=torch.bfloat16, device=device)
    w = w.to(device)
    with pytest.raises(ValueError, match=r"block-wise w_scale must be \[1, 1\]"):
        fp8_gemm_for(SM80, x, w, torch.ones(2, 1, device=device), (128, 128))
    with pytest.raises(ValueError, match="per channel"):
        fp8_gemm_for(SM80, x, w, torch.ones(32, device=device))
    with pytest.raises(ValueError, match="w_scale must be float32"):
        fp8_gemm_for(SM80, x, w, torch.ones(64, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="bk a power of two"):
        fp8_gemm_for(SM80, x, w, torch.ones(1, 2, device=device), (128, 100))
    with pytest.raises(ValueError, match="input_scale must be float32"):
        fp8_gemm_for(SM80, x, w, torch.ones(64, device=device), None,
                     torch.ones(2, device=device))
