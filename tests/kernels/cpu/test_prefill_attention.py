"""The native paged prefill kernel against the torch prefill path (`_prefill_attention`, its
reference): several chunks per call, cached context read through shuffled block tables,
specialised and generic head dims, both bf16 paths, and garbage past each sequence's end."""

from __future__ import annotations

import pytest
import torch

from baton.engine.attention.base import BatchLayout
from baton.engine.attention.torch_backend import TorchAttentionBackend, _prefill_attention

# (context, query) per prefill sequence: fresh prompts, chunks continuing a cached prefix,
# one-row chunks, chunk and context lengths off the block and tile boundaries.
SEQS = [(0, 37), (50, 100), (3, 1), (0, 300), (129, 64), (17, 5)]
# (H, KVH, D): G = 3 and D = 64 (the bundled model), G = 1 and D = 128 (specialised),
# D = 80 and D = 32 with G = 16 (the generic kernel).
SHAPES = [(9, 3, 64), (4, 4, 128), (12, 4, 80), (16, 1, 32)]


@pytest.fixture(scope="module")
def kernel(native_prefill):
    return native_prefill


def make_case(dtype, H, KVH, D, bs, seqs=SEQS, seed=0):
    """Caches filled with random K/V (the chunks' own included, as the backend writes them
    before attention), each sequence on shuffled blocks; returns what the kernel takes plus
    the block lists for the reference."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // bs) for c, n in seqs) + 7  # spare blocks stay unused
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, bs, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, KVH, D, generator=g).to(dtype)
    tables, rows, start = [], [], 0
    for ctx, n in seqs:
        tables.append([perm.pop() for _ in range(-(-(ctx + n) // bs))])
        rows.append([start, n, ctx])
        start += n
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(start, H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(rows), tables


def reference(q, k_cache, v_cache, tables, seqs):
    """The torch prefill path per sequence, in float32 on the same (rounded) inputs."""
    _, bs, KVH, D = k_cache.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    for (start, n, ctx), blocks in zip(seqs.tolist(), tables):
        k = k_cache[blocks].reshape(-1, KVH, D)[: ctx + n].float()  # (L, KVH, D)
        v = v_cache[blocks].reshape(-1, KVH, D)[: ctx + n].float()
        mask = torch.full((n, ctx + n), float("-inf")).triu_(ctx + 1)  # (Q, L)
        out[start:start + n] = _prefill_attention(q[start:start + n].float(), k, v, mask)
    return out


def assert_close(out, ref, dtype):
    # bf16: the output's rounding (2^-9 relative) plus the dot path's bf16 probabilities.
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (5e-3, 1e-2)
    excess = ((out.float() - ref).abs() - rtol * ref.abs()).max().item()
    assert excess <= atol, f"max error over tolerance by {excess:.3g}"


def bf16_paths(kernel):
    return [True, False] if kernel.has_bf16_dot else [False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kvh{}-d{}".format(*s))
@pytest.mark.parametrize("bs", [1, 16, 32])
def test_matches_torch_prefill(kernel, dtype, shape, bs):
    H, KVH, D = shape
    q, k_cache, v_cache, block_tables, seqs, tables = make_case(dtype, H, KVH, D, bs)
    ref = reference(q, k_cache, v_cache, tables, seqs)
    for dot in bf16_paths(kernel) if dtype == torch.bfloat16 else [False]:
        kernel.use_bf16_dot = dot
        out = torch.full_like(q, float("nan"))
        kernel(q, k_cache, v_cache, block_tables, seqs, D ** -0.5, out)
        assert_close(out, ref, dtype)
    kernel.use_bf16_dot = kernel.has_bf16_dot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("garbage", [float("nan"), 1e30])
def test_slots_past_the_sequence_end_are_never_read(kernel, dtype, garbage):
    H, KVH, D, bs = 9, 3, 64, 16
    q, k_cache, v_cache, block_tables, seqs, tables = make_case(dtype, H, KVH, D, bs)
    ref = reference(q, k_cache, v_cache, tables, seqs)
    used = torch.zeros(k_cache.shape[0] * bs, dtype=torch.bool)  # per slot
    for (_, n, ctx), blocks in zip(seqs.tolist(), tables):
        pos = torch.arange(ctx + n)
        used[torch.tensor(blocks)[pos // bs] * bs + pos % bs] = True
    for cache in (k_cache, v_cache):  # the tails of the last blocks and the spare blocks
        cache.view(-1, KVH, D)[~used] = garbage
    for dot in bf16_paths(kernel) if dtype == torch.bfloat16 else [False]:
        kernel.use_bf16_dot = dot
        out = torch.empty_like(q)
        kernel(q, k_cache, v_cache, block_tables, seqs, D ** -0.5, out)
        assert torch.isfinite(out).all()
        assert_close(out, ref, dtype)
    kernel.use_bf16_dot = kernel.has_bf16_dot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_with_kernel_matches_torch_path(kernel, dtype):
    """Decodes and prefill chunks in one step, q a strided view as the model passes it."""
    H, KVH, D, bs = 9, 3, 64, 16
    seqs = [(40, 1), (7, 1), (0, 33), (20, 70)]  # decodes first
    g = torch.Generator().manual_seed(3)
    num_blocks = 32
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, qsl, slots = [], [0], []
    for ctx, n in seqs:
        tables.append([perm.pop() for _ in range(-(-(ctx + n) // bs))])
        qsl.append(qsl[-1] + n)
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(ctx, ctx + n)]
    width = max(len(t) for t in tables)
    layout = BatchLayout(qsl, [c for c, _ in seqs], [c + n for c, n in seqs], num_decodes=2,
                         block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                         slot_mapping=torch.tensor(slots), block_size=bs)
    T = qsl[-1]
    qkv = torch.randn(T, H + 2 * KVH, D, generator=g).to(dtype)  # (T, H + 2 KVH, D)
    q, k, v = qkv[:, :H], qkv[:, H:H + KVH], qkv[:, H + KVH:]
    cache = torch.randn(2, num_blocks, bs, KVH, D, generator=g).to(dtype)
    # The reference: the torch path in float32 on the same (rounded) inputs.
    runs = [(dtype, kernel, (q, k, v, cache)),
            (torch.float32, None, (q.float(), k.float(), v.float(), cache.float()))]
    outs = []
    for dt, prefill, (qr, kr, vr, cr) in runs:
        backend = TorchAttentionBackend(dt, None, prefill)
        k_cache, v_cache = cr.clone().unbind(0)
        outs.append(backend.forward(qr, kr, vr, k_cache, v_cache,
                                    backend.build_metadata(layout)))
    assert_close(outs[0], outs[1], dtype)


def test_unsupported_shapes_are_refused(kernel):
    assert kernel.supports(torch.bfloat16, 9, 3, 64)
    assert not kernel.supports(torch.bfloat16, 17, 1, 64)  # G > 16
    assert not kernel.supports(torch.float32, 4, 4, 72)  # D not a multiple of 16
    assert not kernel.supports(torch.float16, 4, 4, 64)
    q, k_cache, v_cache, block_tables, seqs, _ = make_case(torch.float32, 4, 4, 64, 16)
    k_cache = k_cache[:, :12].contiguous()  # block size 12: not a power of two
    with pytest.raises(RuntimeError, match="code -1"):
        kernel(q, k_cache, k_cache, block_tables, seqs, 0.125, torch.empty_like(q))
