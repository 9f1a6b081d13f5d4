"""FP8 KV caches in the Triton kernels against the pure-torch references: the cache write
(quantised with the layer's scales, saturated, bit-exact) and decode / prefill attention
reading FP8 pages with their scales. Small shapes: the interpreter costs ~7 ms a program."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU

pytest.importorskip("triton")

from baton_kernels import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from tests.kernels.paged_utils import make_paged_cache  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_quantises_like_the_reference(device, cache_dtype, dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, bs, kvh, d, tokens = 4, 16, 2, 32, 21
    k = (torch.randn(tokens, kvh, d, generator=gen) * 3).to(dtype)
    v = (torch.randn(tokens, kvh, d, generator=gen) * 0.01).to(dtype)  # subnormals too
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 447.9])  # saturation and rounding at the top
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[::4] = -1
    k_ref = torch.zeros(num_blocks, bs, kvh, d, dtype=cache_dtype)
    v_ref = torch.zeros_like(k_ref)
    reshape_and_cache_ref(k, v, k_ref, v_ref, slots, 0.5, 0.004)
    k_out, v_out = k_ref.new_zeros(k_ref.shape).to(device), v_ref.new_zeros(k_ref.shape).to(device)
    reshape_and_cache(k.to(device), v.to(device), k_out, v_out, slots.to(device), 0.5, 0.004)
    assert torch.equal(k_out.cpu().view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.cpu().view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", FP8)
def test_every_bf16_value_is_written_as_torch_casts_it(device, cache_dtype):
    """All 65,536 bf16 bit patterns (both zeros, subnormals, infinities, NaNs) by a scale
    that is not a power of two: the bytes equal torch's (a value that rounds to zero keeps
    its sign; a NaN stays a NaN)."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    k = values.reshape(256, 2, 128)
    for scale in (0.0213, 3.7):
        ref = torch.zeros(16, 16, 2, 128, dtype=cache_dtype)
        out = ref.new_zeros(ref.shape).to(device)
        slots = torch.arange(256)
        reshape_and_cache_ref(k, k, ref, ref.clone(), slots, scale, scale)
        reshape_and_cache(k.to(device), k.to(device), out, out.clone(), slots.to(device),
                          scale, scale)
        got, want = out.cpu().view(torch.uint8), ref.view(torch.uint8)
        nan = ref.float().isnan()
        assert out.cpu().float().isnan().equal(nan)
        assert torch.equal(got[~nan], want[~nan])


def fp8_cache(seq_lens, kvh, d, bs, cache_dtype, device):
    """A paged cache (shuffled blocks) quantised to FP8; unused slots hold the largest
    value, so a read past a sequence shows in the output."""
    k, v, tables, lens = make_paged_cache(seq_lens, kvh, d, bs, torch.float32, torch.device("cpu"))
    limit = torch.finfo(cache_dtype).max
    k, v = (x.nan_to_num(limit).clamp(-limit, limit).to(cache_dtype) for x in (k, v))
    return k.to(device), v.to(device), tables.to(device), lens.to(device)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_decode_reads_fp8(device, cache_dtype):
    k, v, tables, lens = fp8_cache([70, 5, 33], 2, 32, 16, cache_dtype, device)
    q = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(1)).to(device)
    out = paged_decode_attention(q, k, v, tables, lens, 0.2, k_scale=0.5, v_scale=3.0)
    ref = paged_decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), lens.cpu(), 0.2,
                                     0.5, 3.0)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_prefill_reads_fp8(device, cache_dtype):
    seq_lens, query_lens = [40, 9], [24, 9]  # one chunk over a cached prefix, one fresh
    k, v, tables, lens = fp8_cache(seq_lens, 2, 32, 16, cache_dtype, device)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    q = torch.randn(sum(query_lens), 4, 32, generator=torch.Generator().manual_seed(2))
    qsl = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    out = paged_prefill_attention(q.to(dtype).to(device), k, v, tables, qsl.to(device), lens,
                                  0.2, k_scale=0.5, v_scale=3.0)
    ref = paged_prefill_attention_ref(q.to(dtype), k.cpu(), v.cpu(), tables.cpu(), qsl,
                                      lens.cpu(), 0.2, 0.5, 3.0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_triton_backend_matches_torch_backend_on_fp8(cache_dtype):
    """The engine's triton backend and its torch backend on one mixed batch over an FP8
    cache with scales: the same bytes written, the same attention read back."""
    from baton.engine.attention.base import LayerAttention
    from baton.engine.attention.kv_quant import quantize
    from baton.engine.attention.torch_backend import TorchAttentionBackend
    from baton.engine.attention.triton_backend import TritonAttentionBackend
    from tests.unit.engine.test_attention import make_case

    q, k, v, k32, v32, layout, _ = make_case(torch.float32, seed=4, D=32)
    spec = LayerAttention(32 ** -0.5, k_scale=0.25, v_scale=4.0)
    k_cache, v_cache = quantize(k32, 0.25, cache_dtype), quantize(v32 * 4, 4.0, cache_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_backend = TorchAttentionBackend(torch.float32)
    ref = torch_backend.forward(q, k, v * 4, ref_k, ref_v, torch_backend.build_metadata(layout),
                                spec)
    dev = torch.device("cuda" if ON_GPU else "cpu")
    layout.block_tables, layout.slot_mapping = (layout.block_tables.to(dev),
                                                layout.slot_mapping.to(dev))
    k_cache, v_cache = k_cache.to(dev), v_cache.to(dev)
    backend = TritonAttentionBackend(torch.float32)
    out = backend.forward(q.to(dev), k.to(dev), (v * 4).to(dev), k_cache, v_cache,
                          backend.build_metadata(layout), spec)
    assert torch.equal(k_cache.cpu().view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), ref_v.view(torch.uint8))
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
