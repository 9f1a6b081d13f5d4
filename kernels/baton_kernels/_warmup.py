"""warmup: launch every kernel variant a model's engine can use, once, before serving.

A variant (`_variants`) depends only on the query dtype, the cache (dtype, block size, KV
heads, head dim), the query heads (this rank's) and whether a layer soft-caps its scores; a
sliding window, the scales, the batch, the lengths and the split count are runtime values.
So one launch of each kernel per soft-cap setting compiles them all: the decode kernel with
one split (the final output path) and with MAX_SPLITS (the partials path, and the reduce),
the prefill kernel, and the cache write. On CUDA each first launch compiles the variant, or
loads it from Triton's cache (TRITON_CACHE_DIR); in the interpreter it only runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from baton_kernels.cache_ops import reshape_and_cache
from baton_kernels.decode_attention import MAX_SPLITS, paged_decode_attention
from baton_kernels.prefill_attention import paged_prefill_attention


def warmup(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
           softcaps: Iterable[float | None] = (None,)) -> None:
    """Launch every variant for queries of ``dtype`` with ``num_heads`` heads over one layer's
    ``k_cache`` / ``v_cache`` (``[num_blocks, block_size, kv_heads, head_dim]``, any dtype the
    kernels take, FP8 included); ``softcaps``: each layer's soft-cap (None: off).

    Reads block 0 of the caches and writes nothing (every slot is -1). Blocks the calling
    thread until the launches are queued (compiling first where needed)."""
    device = k_cache.device
    _, _, num_kv_heads, head_dim = k_cache.shape
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)      # (1, H, D)
    kv = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=device)  # (1, KVH, D)
    reshape_and_cache(kv, kv, k_cache, v_cache,
                      torch.full((1,), -1, dtype=torch.int64, device=device))
    tables = torch.zeros(1, 1, dtype=torch.int32, device=device)  # (1, 1): block 0
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    for capped in sorted({cap is not None for cap in softcaps}):
        softcap = 30.0 if capped else None  # the value is a runtime argument
        for splits in (1, MAX_SPLITS):
            paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale,
                                   num_splits=splits, softcap=softcap)
        paged_prefill_attention(q, k_cache, v_cache, tables, query_start_loc, seq_lens, scale,
                                softcap=softcap)
