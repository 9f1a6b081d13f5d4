"""The CPU attention backend (native decode kernel and the gather + SDPA fallback) against a
plain reference: ragged lengths, shuffled physical blocks, decodes mixed with prefill chunks
that have cached context."""

from __future__ import annotations

import pytest
import torch

from baton.engine.attention.base import BatchLayout
from baton.engine.attention.torch_backend import TorchAttentionBackend

H, KVH, BS = 6, 2, 4


def reference(q, k_cache, v_cache, tables, ctx_lens, seq_lens, qsl):
    D = q.shape[-1]
    out = torch.empty_like(q, dtype=torch.float32)
    for i in range(len(seq_lens)):
        blocks = tables[i][: -(-seq_lens[i] // BS)]
        k = k_cache[blocks].reshape(-1, KVH, D)[: seq_lens[i]].float()
        v = v_cache[blocks].reshape(-1, KVH, D)[: seq_lens[i]].float()
        k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
        for r, pos in enumerate(range(ctx_lens[i], seq_lens[i])):
            qi = q[qsl[i] + r].float()  # (H, D)
            scores = torch.einsum("hd,lhd->hl", qi, k[: pos + 1]) * D ** -0.5
            out[qsl[i] + r] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: pos + 1])
    return out


def make_case(dtype, seed=0, D=32):
    g = torch.Generator().manual_seed(seed)
    # (context, query) per sequence: decodes first, then prefill chunks.
    seqs = [(0, 1), (BS - 1, 1), (BS, 1), (37, 1), (3, 1), (0, 9), (11, 5), (8, 8)]
    num_blocks = 64
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, qsl, ctx_lens, seq_lens, slots = [], [0], [], [], []
    for ctx, n in seqs:
        nb = -(-(ctx + n) // BS)
        tables.append([perm.pop() for _ in range(nb)])
        qsl.append(qsl[-1] + n)
        ctx_lens.append(ctx)
        seq_lens.append(ctx + n)
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(ctx, ctx + n)]
    T = qsl[-1]
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, KVH, D, generator=g).to(dtype)
    v = torch.randn(T, KVH, D, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    layout = BatchLayout(qsl, ctx_lens, seq_lens, num_decodes=5, block_tables=table,
                         slot_mapping=torch.tensor(slots), block_size=BS)
    return q, k, v, k_cache, v_cache, layout, tables


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("head_dim", [32, 64])  # 64 with G=3 takes a specialised kernel
def test_backend_matches_reference(dtype, tol, use_native, head_dim, request):
    native = request.getfixturevalue("native_decode") if use_native else None
    q, k, v, k_cache, v_cache, layout, tables = make_case(dtype, D=head_dim)
    D = head_dim
    backend = TorchAttentionBackend(dtype, native)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout))
    # The backend wrote the new K/V into the cache; the reference reads them from there.
    written = k_cache.view(-1, KVH, D)[layout.slot_mapping]
    assert torch.equal(written, k)
    ref = reference(q, k_cache, v_cache, tables, layout.context_lens, layout.seq_lens,
                    layout.query_start_loc)
    assert (out.float() - ref).abs().max().item() < tol


def test_padding_rows_are_not_written(tmp_path):
    q, k, v, k_cache, v_cache, layout, _ = make_case(torch.float32, seed=1)
    layout.slot_mapping[0] = -1
    before = k_cache.clone()
    backend = TorchAttentionBackend(torch.float32, None)
    backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(layout))
    changed = (k_cache != before).any(-1).any(-1).view(-1)  # per slot
    assert int(changed.sum()) == len(layout.slot_mapping) - 1


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (10, 2, 96),
                                                     (4, 4, 64)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_native_decode_kernel_shapes(dtype, tol, heads, kv_heads, head_dim, block_size,
                                     native_decode):
    """The native decode kernel alone, specialised (G, D) and generic, over block sizes and
    lengths from 0 (a padding row: zero output) to several blocks, on shuffled blocks."""
    native = native_decode
    g = torch.Generator().manual_seed(heads * block_size)
    lens = [0, 1, block_size, block_size + 1, 3 * block_size - 1, 77]
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).contiguous()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    native(q, k_cache, v_cache, tables, torch.tensor(lens), head_dim ** -0.5, out)
    group = heads // kv_heads
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        k = k_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:n].float()
        v = v_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:n].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * head_dim ** -0.5
        ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
        assert (out[i].float() - ref).abs().max().item() < tol, (i, n)
        # Alone, the sequence is split over its kv heads: the same arithmetic per head.
        one = torch.full_like(q[i:i + 1], float("nan"))
        native(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], torch.tensor([n]),
               head_dim ** -0.5, one)
        assert torch.equal(one[0], out[i])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_native_decode_long_contexts_with_peaked_scores(heads, kv_heads, head_dim,
                                                        native_decode):
    """Hundreds of tokens whose largest scores sit in different 16-token chunks, with scores
    spread over ~+-60: the running max moves from chunk to chunk, so the softmax is rescaled
    many times (the single-pass bf16 kernel) and exp underflows for most tokens."""
    g = torch.Generator().manual_seed(7)
    block_size, lens = 16, [700, 333, 17]
    width = -(-max(lens) // block_size)
    num_blocks = len(lens) * width
    tables = torch.randperm(num_blocks, generator=g).view(len(lens), width).contiguous()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g) * 8  # scores of +-60
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        kc, vc, qd = k_cache.to(dtype), v_cache.to(dtype), q.to(dtype)
        out = torch.full_like(qd, float("nan"))
        native_decode(qd, kc, vc, tables, torch.tensor(lens), head_dim ** -0.5, out)
        group = heads // kv_heads
        for i, n in enumerate(lens):
            k = kc[tables[i]].reshape(-1, kv_heads, head_dim)[:n].float()
            v = vc[tables[i]].reshape(-1, kv_heads, head_dim)[:n].float()
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("hd,lhd->hl", qd[i].float(), k) * head_dim ** -0.5
            assert scores.max() - scores.min() > 40  # really peaked
            ref = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
            assert (out[i].float() - ref).abs().max().item() < tol, (dtype, i, n)
