"""reshape_and_cache kernel against the pure-torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU

pytest.importorskip("triton")

from baton_kernels import reshape_and_cache, reshape_and_cache_ref  # noqa: E402

CASES = [  # dtype, num_kv_heads, head_dim, block_size, slot dtype
    (torch.float32, 2, 64, 16, torch.int64),
    (torch.float16, 3, 80, 32, torch.int32),
    (torch.bfloat16, 1, 96, 16, torch.int64),
    (torch.float16, 2, 128, 32, torch.int64),
]
if ON_GPU:
    CASES += [(dt, kvh, d, bs, torch.int64) for dt in (torch.float16, torch.bfloat16,
                                                        torch.float32)
              for kvh in (1, 8) for d in (64, 80, 96, 128) for bs in (16, 32)]


@pytest.mark.parametrize("dtype,num_kv_heads,head_dim,block_size,slot_dtype", CASES)
def test_matches_reference(device, dtype, num_kv_heads, head_dim, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 37
    # k/v as strided views of a fused qkv-like buffer: token stride != KVH * D.
    fused = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1                                  # padding tokens are skipped
    slots = slots.to(slot_dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(k, v, k_ref, v_ref, slots)

    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    reshape_and_cache(k.to(device), v.to(device), k_dev, v_dev, slots.to(device))
    # Exact copy: compare bit patterns so untouched NaN slots must stay NaN too.
    assert torch.equal(k_dev.cpu().isnan(), k_ref.isnan())
    assert torch.equal(k_dev.cpu().nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_dev.cpu().nan_to_num(), v_ref.nan_to_num())
    assert torch.equal(v_dev.cpu().isnan(), v_ref.isnan())


def test_rejects_bad_arguments(device):
    cache = torch.zeros(4, 16, 2, 64, device=device)
    k = torch.zeros(3, 2, 64, device=device)
    slots = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="dtype"):
        reshape_and_cache(k.half(), k.half(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="KV heads"):
        reshape_and_cache(k[:, :1], k[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(k, k, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="last dimension"):
        t = torch.zeros(3, 2, 128, device=device)[..., ::2]
        reshape_and_cache(t, t, cache, cache.clone(), slots)
