"""W4A16 / W8A16 (`baton_kernels.quant_gemm`) against the float32 reference that de-quantizes
the same codes (`quant_reference`): int4 and int8, symmetric and with zeros, groups of 32, 64,
128, an odd 40 and one per channel, GPTQ act-order (a shuffled g_idx), decode and prefill row
counts, N and K off the tiles, split-K. On CUDA when present, else the interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.quant_utils import assert_gemm_close, make_int_weight

pytest.importorskip("triton")

from baton_kernels.quant_pack import (  # noqa: E402
    group_major,
    pack_int_weight,
    unpack_int_weight,
)
from baton_kernels.quant_reference import int_weight_gemm_ref  # noqa: E402

N, K = 72, 200  # N off the 64-column tile; K off every K tile, a multiple of 8


def run_gemm(device, x, weight, n=N, k=K):
    from baton_kernels.quant_gemm import int_weight_gemm

    zeros = weight.zeros
    return int_weight_gemm(
        x.to(device), pack_int_weight(weight.codes, weight.bits).to(device),
        group_major(weight.scales).to(device),
        group_major(zeros).to(device) if zeros is not None else None,
        weight.g_idx.to(device) if weight.g_idx is not None else None,
        weight.group_size, weight.bits, n, k)


def reference(x, weight):
    return int_weight_gemm_ref(x, weight.codes, weight.scales, weight.zeros, weight.g_idx,
                               weight.group_size, weight.bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, 40, K])  # 40: groups across tiles
def test_matches_the_reference(device, bits, asymmetric, group_size):
    weight = make_int_weight(N, K, bits, group_size, asymmetric=asymmetric, act_order=False,
                             seed=bits + group_size)
    gen = torch.Generator().manual_seed(group_size)
    for m, dtype in ((1, torch.bfloat16), (7, torch.float16), (33, torch.bfloat16)):
        x = torch.randn(m, K, generator=gen).to(dtype)
        assert_gemm_close(run_gemm(device, x, weight).cpu(), reference(x, weight))


@pytest.mark.parametrize("bits,asymmetric,group_size", [(4, False, 128), (4, True, 32),
                                                        (8, True, 64)])
def test_act_order_matches_the_reference(device, bits, asymmetric, group_size):
    weight = make_int_weight(N, K, bits, group_size, asymmetric=asymmetric, act_order=True,
                             seed=7)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 7, 33):
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        want = reference(x, weight)
        assert_gemm_close(run_gemm(device, x, weight).cpu(), want)
        shuffled_away = reference(x, make_int_weight(N, K, bits, group_size,
                                                     asymmetric=asymmetric, act_order=False,
                                                     seed=7))
        assert not torch.allclose(want.float(), shuffled_away.float(), atol=1e-2)


def test_prefill_rows_and_canonical_strides(device):
    """A prefill-sized M (the largest bucket, no split) with scales / zeros as checkpoints
    store them (row-major [N, G]): the same result, the strides only cost speed."""
    from baton_kernels.quant_gemm import int_weight_gemm

    weight = make_int_weight(N, K, 4, 64, asymmetric=True, act_order=False, seed=3,
                             scale_dtype=torch.float16)
    x = torch.randn(300, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = int_weight_gemm(x.to(device), pack_int_weight(weight.codes, 4).to(device),
                          weight.scales.to(device), weight.zeros.to(device), None, 64, 4, N, K)
    assert_gemm_close(got.cpu(), reference(x, weight))
    assert int_weight_gemm(x[:0].to(device), pack_int_weight(weight.codes, 4).to(device),
                           weight.scales.to(device), None, None, 64, 4, N, K).shape == (0, N)


def test_pack_layout_is_gptq_qweight():
    """Code j of word packed[p, n] is codes[n, 8 p + j] in bits 4 j .. 4 j + 3 (int4), and
    4 codes of 8 bits for int8; unpack inverts it."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 1)  # (N=3, K=16): k = code
    packed = pack_int_weight(codes, 4)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3)
    assert packed[0, 0].item() == 0x76543210
    assert packed[1, 2].item() == 0xFEDCBA98 - (1 << 32)  # two's complement
    assert pack_int_weight(codes, 8)[0, 1].item() == 0x03020100
    rand = torch.randint(0, 256, (5, 24), dtype=torch.uint8)
    assert torch.equal(unpack_int_weight(pack_int_weight(rand, 8), 8), rand)
    assert torch.equal(unpack_int_weight(pack_int_weight(rand % 16, 4), 4), rand % 16)


def test_refuses_what_does_not_fit(device):
    from baton_kernels.quant_gemm import int_weight_gemm

    with pytest.raises(ValueError, match="not a multiple of 8"):
        pack_int_weight(torch.zeros(4, 20, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="above the int4 range"):
        pack_int_weight(torch.full((4, 16), 16, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_int_weight(torch.zeros(4, 16, dtype=torch.uint8), 3)
    packed = torch.zeros(2, 8, dtype=torch.int32, device=device)
    scales = torch.ones(8, 1, device=device)
    x = torch.zeros(1, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="K = 20 is not a multiple of 8"):
        int_weight_gemm(torch.zeros(1, 20, dtype=torch.bfloat16, device=device), packed,
                        scales, None, None, 20, 4, 8, 20)
    with pytest.raises(ValueError, match=r"scales must be \[N=8, G=2\]"):
        int_weight_gemm(x, packed, scales, None, None, 8, 4, 8, 16)
    with pytest.raises(ValueError, match="dtype torch.float32"):
        int_weight_gemm(x.float(), packed, scales, None, None, 16, 4, 8, 16)
    with pytest.raises(ValueError, match="g_idx must be"):
        int_weight_gemm(x, packed, scales, None, torch.zeros(15, dtype=torch.int32,
                                                             device=device), 16, 4, 8, 16)


def test_one_call_per_bucket_compiles_what_serving_launches(device):
    """Warm-up at `BUCKET_ROWS` launches every variant (constexprs, split or not) that any
    row count launches later: the split count follows the bucket, not M."""
    from baton_kernels import recording_variants
    from baton_kernels._gemm import BUCKET_ROWS

    weight = make_int_weight(N, K, 4, 128, asymmetric=False, act_order=False)
    with recording_variants() as warm:
        for m in BUCKET_ROWS:
            run_gemm(device, torch.zeros(m, K, dtype=torch.bfloat16), weight)
    with recording_variants() as served:
        for m in (1, 5, 17, 40, 100, 300):
            run_gemm(device, torch.zeros(m, K, dtype=torch.bfloat16), weight)
    assert served and served <= warm
    assert len({key[2] for key in warm}) == len(BUCKET_ROWS)  # the buckets' constexprs differ
