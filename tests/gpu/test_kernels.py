"""The Triton kernels of baton_kernels on the device against their pure-torch references
(kernels/baton_kernels/reference.py): the cache write, decode and prefill attention, at
Llama-3-8B's attention shape (32 heads, 8 KV heads, head dim 128), FP8 caches too."""

from __future__ import annotations

import pytest
import torch

from baton_kernels import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from tests.kernels.paged_utils import assert_close, make_paged_cache

H, KVH, D = 32, 8, 128
SCALE = D ** -0.5
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, *FP8])
def test_reshape_and_cache_writes_like_the_reference(cuda, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, tokens = 64, 16, 700
    dtype = torch.bfloat16 if cache_dtype in FP8 else cache_dtype  # the model's K/V dtype
    k = torch.randn(tokens, KVH, D, generator=gen).to(dtype)
    v = torch.randn(tokens, KVH, D, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[::7] = -1  # padding rows are skipped
    k_ref = torch.zeros(num_blocks, bs, KVH, D, dtype=cache_dtype)
    v_ref = torch.zeros_like(k_ref)
    reshape_and_cache_ref(k, v, k_ref, v_ref, slots, 0.5, 0.25)
    k_out, v_out = torch.zeros_like(k_ref, device=cuda), torch.zeros_like(v_ref, device=cuda)
    reshape_and_cache(k.to(cuda), v.to(cuda), k_out, v_out, slots.to(cuda), 0.5, 0.25)
    torch.cuda.synchronize()
    assert k_out.is_cuda
    assert torch.equal(k_out.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.cpu().view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_lens", [[1, 17, 255, 1024], [4096] * 3 + [33]])
def test_decode_attention_matches_the_reference(cuda, dtype, seq_lens):
    k, v, tables, lens = make_paged_cache(seq_lens, KVH, D, 16, dtype, cuda)
    q = torch.randn(len(seq_lens), H, D, generator=torch.Generator().manual_seed(1)).to(
        dtype).to(cuda)
    out = paged_decode_attention(q, k, v, tables, lens, SCALE)
    assert out.is_cuda
    ref = paged_decode_attention_ref(q, k, v, tables, lens, SCALE)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_attention_matches_the_reference(cuda, dtype):
    # Mixed query lengths over cached prefixes: a fresh prompt, a chunk after a prefix, a
    # single token, a long one.
    seq_lens, query_lens = [300, 1000, 65, 2048], [300, 128, 1, 777]
    k, v, tables, lens = make_paged_cache(seq_lens, KVH, D, 16, dtype, cuda)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=cuda)
    q = torch.randn(sum(query_lens), H, D, generator=torch.Generator().manual_seed(2)).to(
        dtype).to(cuda)
    out = paged_prefill_attention(q, k, v, tables, starts, lens, SCALE)
    assert out.is_cuda
    ref = paged_prefill_attention_ref(q, k, v, tables, starts, lens, SCALE)
    assert_close(out, ref, dtype)


def fp8_cache(seq_lens, cache_dtype, device):
    k, v, tables, lens = make_paged_cache(seq_lens, KVH, D, 16, torch.float32, device)
    limit = torch.finfo(cache_dtype).max
    k, v = (x.nan_to_num(limit).clamp(-limit, limit).to(cache_dtype) for x in (k, v))
    return k, v, tables, lens


@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_decode_and_prefill_read_with_their_scales(cuda, cache_dtype):
    seq_lens = [70, 513, 1500]
    k, v, tables, lens = fp8_cache(seq_lens, cache_dtype, cuda)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, H, D, generator=gen).to(torch.bfloat16).to(cuda)
    out = paged_decode_attention(q, k, v, tables, lens, SCALE, k_scale=0.5, v_scale=3.0)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, SCALE, 0.5, 3.0)
    assert_close(out, ref, torch.bfloat16)
    query_lens = [70, 13, 1]
    starts = torch.tensor([0, 70, 83, 84], dtype=torch.int32, device=cuda)
    qp = torch.randn(sum(query_lens), H, D, generator=gen).to(torch.bfloat16).to(cuda)
    out = paged_prefill_attention(qp, k, v, tables, starts, lens, SCALE, k_scale=0.5,
                                  v_scale=3.0)
    ref = paged_prefill_attention_ref(qp, k, v, tables, starts, lens, SCALE, 0.5, 3.0)
    assert_close(out, ref, torch.bfloat16)
