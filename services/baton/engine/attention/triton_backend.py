"""Attention on GPU: the Triton kernels of `baton_kernels` over the paged cache in place.

Per layer: one `reshape_and_cache` launch writes the step's K/V, then one
`paged_decode_attention` (split-K over each sequence's live keys) covers the decode rows and
one `paged_prefill_attention` the prefill chunks. Metadata is device tensors only, built once
per step, so a decode step's metadata can also live in the static buffers of a captured CUDA
graph (`decode_metadata`): there the split count is fixed per batch size and the kernel
spreads each live context over the splits. On CPU the kernels run only in Triton's
interpreter (tests). An FP8 cache is written and read with each layer's scales
(`LayerAttention.k_scale` / `v_scale`).

Start-up: the backend points Triton's compile cache at `<cache_dir>/triton` (unless
TRITON_CACHE_DIR is set) so compiled kernels outlive the process, and `warmup` launches every
kernel variant the model can use, so no request waits on a JIT compile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.engine.attention.base import AttentionBackend, BatchLayout, LayerAttention

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


@dataclass
class DecodePart:
    """Rows [0, n) of the batch: one query token each."""

    block_tables: torch.Tensor  # (n, W) int32
    seq_lens: torch.Tensor  # (n,) int32, 0 for padding rows (their output is zero)
    # The longest context when the host knows it (eager steps): it bounds the split count.
    # None in a CUDA graph: splits by occupancy alone, fixed for the captured size.
    max_seq_len: int | None = None


@dataclass
class PrefillPart:
    """Query tokens [num_decode_tokens, T) of the batch, in chunks per sequence."""

    block_tables: torch.Tensor  # (m, W) int32
    query_start_loc: torch.Tensor  # (m + 1,) int32, from 0
    seq_lens: torch.Tensor  # (m,) int32


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64, -1 = do not write
    num_decode_tokens: int
    decode: DecodePart | None
    prefill: PrefillPart | None


def use_persistent_triton_cache(cache_dir: str | Path) -> Path:
    """Point Triton's compile cache at `cache_dir`/triton unless TRITON_CACHE_DIR is already
    set (the user's choice wins); returns the directory in use. Triton reads the variable
    at each compile, so this works before or after triton is imported."""
    os.environ.setdefault(TRITON_CACHE_ENV, str(Path(cache_dir) / "triton"))
    return Path(os.environ[TRITON_CACHE_ENV])


class TritonAttentionBackend(AttentionBackend[TritonAttentionMetadata]):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, dtype: torch.dtype, cache_dir: str | Path | None = None) -> None:
        """`cache_dir`: the engine's cache directory; Triton's compiled kernels go under it
        (None: leave Triton's cache where it is)."""
        if cache_dir is not None:
            use_persistent_triton_cache(cache_dir)
        import baton_kernels

        self.dtype = dtype
        self._ops = baton_kernels

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
               specs: list[LayerAttention], num_heads: int) -> None:
        """Launch every kernel variant this model's steps can use (on CUDA: compile them
        now), over one layer's caches, reading and writing no sequence's KV. `specs`: every
        layer's attention spec; `num_heads`: query heads on this rank. Called once by the
        model runner before it captures CUDA graphs."""
        self._ops.warmup(self.dtype, k_cache, v_cache, num_heads,
                         [spec.softcap for spec in specs] or [None])

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:
        dev, bs, nd = layout.slot_mapping.device, layout.block_size, layout.num_decodes
        # One host-to-device copy for every small integer vector of the step.
        qsl = layout.query_start_loc
        base = qsl[nd]
        ints = torch.tensor(layout.seq_lens + [q - base for q in qsl[nd:]],
                            dtype=torch.int32).to(dev, non_blocking=True)
        tables = layout.block_tables.to(torch.int32)
        decode = prefill = None
        if nd:
            longest = max(layout.seq_lens[:nd])
            decode = DecodePart(tables[:nd, :-(-longest // bs)], ints[:nd], longest)
        if nd < layout.num_seqs:
            n = layout.num_seqs
            prefill = PrefillPart(tables[nd:], ints[n:], ints[nd:n])
        return TritonAttentionMetadata(layout.slot_mapping, base, decode, prefill)

    def decode_metadata(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        slot_mapping: torch.Tensor) -> TritonAttentionMetadata:
        """Metadata of an all-decode batch over caller-owned buffers (a CUDA graph's static
        inputs): (n, W) int32 tables, (n,) int32 lengths, (n,) int64 slots. The host knows
        no length here, so the split count depends on n alone and one captured launch fits
        every context."""
        n = seq_lens.shape[0]
        return TritonAttentionMetadata(slot_mapping, n, DecodePart(block_tables, seq_lens), None)

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonAttentionMetadata,
                spec: LayerAttention | None = None):
        ops = self._ops
        spec = spec or LayerAttention(q.shape[-1] ** -0.5)
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=spec.k_scale,
                              v_scale=spec.v_scale)  # FP8 caches' scales
        kv = dict(k_scale=spec.k_scale, v_scale=spec.v_scale,
                  sliding_window=spec.sliding_window, softcap=spec.softcap)
        scale = spec.scale
        nd, d, p = meta.num_decode_tokens, meta.decode, meta.prefill
        if p is None:
            assert d is not None  # no prefill part: the batch is all decodes
            return ops.paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens,
                                              scale, max_seq_len=d.max_seq_len, **kv)
        out_p = ops.paged_prefill_attention(q[nd:], k_cache, v_cache, p.block_tables,
                                            p.query_start_loc, p.seq_lens, scale, **kv)
        if d is None:
            return out_p
        out_d = ops.paged_decode_attention(q[:nd], k_cache, v_cache, d.block_tables,
                                           d.seq_lens, scale, max_seq_len=d.max_seq_len, **kv)
        return torch.cat((out_d, out_p))
