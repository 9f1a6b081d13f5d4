"""Every kernel variant is launched at start: after `TritonAttentionBackend.warmup`, a run of
realistic steps (decode batches of 1..max_num_seqs, short and long contexts, mixed and
prefill-only steps, CUDA-graph-style decodes over max_model_len-wide static tables, a plain
layer and a windowed soft-capped one) launches no variant warm-up did not. In the interpreter
nothing compiles, so the check is on the variant keys the launch wrappers record; on a GPU the
test also counts Triton's compiled kernels, which must not grow after warm-up.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU

pytest.importorskip("triton")

from baton.engine.attention.base import BatchLayout, LayerAttention  # noqa: E402
from baton.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from baton_kernels import recording_variants  # noqa: E402

H, KVH, D, BS = 4, 2, 32, 16
MAX_NUM_SEQS = 20
MAX_MODEL_LEN = 4096
SPECS = [LayerAttention(D ** -0.5), LayerAttention(D ** -0.5, sliding_window=40, softcap=5.0)]


def make_layout(seqs: list[tuple[int, int]], device, first_block: int = 0) -> BatchLayout:
    """(context, query) per sequence, decodes (query 1) first; blocks handed out in order."""
    tables, qsl, slots, next_block = [], [0], [], first_block
    for ctx, n in seqs:
        blocks = -(-(ctx + n) // BS)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        qsl.append(qsl[-1] + n)
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(ctx, ctx + n)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return BatchLayout(qsl, [c for c, _ in seqs], [c + n for c, n in seqs],
                       sum(n == 1 for _, n in seqs), table.to(device),
                       torch.tensor(slots, dtype=torch.int64).to(device), BS)


def realistic_steps() -> list[list[tuple[int, int]]]:
    steps = [[(0, 37)], [(0, 300), (0, 5)], [(0, 3 + i) for i in range(MAX_NUM_SEQS)]]
    steps += [[(20 + 37 * i, 1) for i in range(n)] for n in (1, 2, 3, 5, 8, 13, MAX_NUM_SEQS)]
    steps += [[(1500, 1)], [(2, 1), (900, 1), (15, 1)]]                      # long / short
    steps += [[(700, 1), (3, 1), (0, 64), (100, 16)], [(31, 1), (64, 33)]]   # mixed
    return steps


def qkv_views(tokens: int, device, gen):
    """q, k, v as a model passes them: views of one fused projection, (T, (H + 2 KVH) D)."""
    qkv = torch.randn(tokens, (H + 2 * KVH) * D, generator=gen).to(device)
    q = qkv[:, :H * D].view(tokens, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(tokens, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(tokens, KVH, D)
    return q, k, v


def compiled_count(device) -> int:
    """Kernels Triton has compiled in this process (GPU only)."""
    import baton_kernels.cache_ops as c
    import baton_kernels.decode_attention as d
    import baton_kernels.prefill_attention as p

    kernels = (c.reshape_and_cache_kernel, d.paged_decode_split_kernel,
               d.paged_decode_reduce_kernel, p.paged_prefill_kernel)
    return sum(len(entry[0]) for k in kernels for entry in k.fn.device_caches.values())


def test_steps_after_warmup_launch_only_warmed_variants(device):
    dtype = torch.float32
    num_blocks = 1024
    kv = torch.zeros(len(SPECS), 2, num_blocks, BS, KVH, D, dtype=dtype, device=device)
    kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(len(SPECS))]
    backend = TritonAttentionBackend(dtype)
    with recording_variants() as warmed:
        backend.warmup(*kv_caches[0], SPECS, H)
    assert 4 <= len(warmed) <= 7  # write; decode, reduce and prefill per soft-cap setting
    compiled = compiled_count(device) if ON_GPU else 0

    gen = torch.Generator().manual_seed(0)
    with recording_variants() as used:
        for seqs in realistic_steps():
            layout = make_layout(seqs, device)
            meta = backend.build_metadata(layout)
            q, k, v = qkv_views(layout.query_start_loc[-1], device, gen)
            for layer, spec in enumerate(SPECS):
                backend.forward(q, k, v, *kv_caches[layer], meta, spec)
        # CUDA-graph decodes: static max_model_len-wide tables, padded rows of length 0.
        for size in (1, 2, 4, 16, MAX_NUM_SEQS):
            tables = torch.zeros(size, MAX_MODEL_LEN // BS, dtype=torch.int32, device=device)
            tables[:, :40] = torch.arange(40, dtype=torch.int32)
            lens = torch.tensor(([600, 3, 0, 0, 17] * 4)[:size], dtype=torch.int32,
                                device=device)
            slots = torch.full((size,), -1, dtype=torch.int64, device=device)
            meta = backend.decode_metadata(tables, lens, slots)
            q, k, v = qkv_views(size, device, gen)
            for layer, spec in enumerate(SPECS):
                backend.forward(q, k, v, *kv_caches[layer], meta, spec)
    assert used, "the steps launched nothing"
    assert used <= warmed, f"launched after warm-up: {used - warmed}"
    if ON_GPU:
        torch.cuda.synchronize()
        assert compiled_count(device) == compiled


def test_warmup_covers_fp8_caches_and_bf16(device):
    dtype = torch.bfloat16
    cache = torch.zeros(2, 64, BS, KVH, D, dtype=torch.float8_e4m3fn, device=device)
    backend = TritonAttentionBackend(dtype)
    plain = [LayerAttention(D ** -0.5, k_scale=0.5, v_scale=2.0)]
    with recording_variants() as warmed:
        backend.warmup(cache[0], cache[1], plain, H)
    layout = make_layout([(300, 1), (5, 1), (0, 20)], device)
    q, k, v = qkv_views(layout.query_start_loc[-1], device, torch.Generator().manual_seed(1))
    with recording_variants() as used:
        backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache[0], cache[1],
                        backend.build_metadata(layout), plain[0])
    assert used and used <= warmed, used - warmed


def test_recorded_keys_see_what_triton_specialises_on(device):
    # The recorder is only a proof if it sees what would compile a new variant: a
    # specialised integer turning 1 or a multiple of 16, a constexpr, a dtype.
    from baton_kernels.cache_ops import reshape_and_cache_kernel as kernel

    k = torch.zeros(4, KVH, D, device=device)
    args = [k, k, k, k, torch.zeros(4, dtype=torch.int64, device=device), 4, 16,
            *(64, 32, 64, 32, 1024, 64, 32), 1.0, 1.0, 0.0]
    key = kernel.variant_key(tuple(args), {"HEAD_DIM": D}, 4)
    assert kernel.variant_key(tuple(args[:5] + [999] + args[6:]), {"HEAD_DIM": D}, 4) == key
    assert kernel.variant_key(tuple(args[:6] + [17] + args[7:]), {"HEAD_DIM": D}, 4) != key
    assert kernel.variant_key(tuple(args), {"HEAD_DIM": 64}, 4) != key
    assert kernel.variant_key(tuple([k.half()] + args[1:]), {"HEAD_DIM": D}, 4) != key
