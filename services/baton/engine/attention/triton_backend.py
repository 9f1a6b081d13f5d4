"""Attention on GPU: the Triton kernels of `baton_kernels` over the paged cache in place.

Per layer: one `reshape_and_cache` launch writes the step's K/V, then one
`paged_decode_attention` (split-K) covers the decode rows and one `paged_prefill_attention`
the prefill chunks. Metadata is device tensors only, built once per step, so a decode step's
metadata can also live in the static buffers of a captured CUDA graph (`decode_metadata`).
On CPU the kernels run only in Triton's interpreter (tests). An FP8 cache is written and read
with each layer's scales (`LayerAttention.k_scale` / `v_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.attention.base import AttentionBackend, BatchLayout, LayerAttention


@dataclass
class DecodePart:
    """Rows [0, n) of the batch: one query token each."""

    block_tables: torch.Tensor  # (n, W) int32; W * block_size bounds the split-K chunks
    seq_lens: torch.Tensor  # (n,) int32, 0 for padding rows (their output is zero)


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


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, dtype: torch.dtype) -> None:
        import baton_kernels

        self.dtype = dtype
        self._ops = baton_kernels

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
            # Decodes come longest first: the first row's blocks bound the table width.
            width = -(-layout.seq_lens[0] // bs)
            decode = DecodePart(tables[:nd, :width], ints[:nd])
        if nd < layout.num_seqs:
            n = layout.num_seqs
            prefill = PrefillPart(tables[nd:], ints[n:], ints[nd:n])
        return TritonAttentionMetadata(layout.slot_mapping, base, decode, prefill)

    def decode_metadata(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        slot_mapping: torch.Tensor) -> TritonAttentionMetadata:
        """Metadata of an all-decode batch over caller-owned buffers (a CUDA graph's static
        inputs): (n, W) int32 tables, (n,) int32 lengths, (n,) int64 slots."""
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
            return ops.paged_decode_attention(q, k_cache, v_cache, d.block_tables, d.seq_lens,
                                              scale, **kv)
        out_p = ops.paged_prefill_attention(q[nd:], k_cache, v_cache, p.block_tables,
                                            p.query_start_loc, p.seq_lens, scale, **kv)
        if d is None:
            return out_p
        out_d = ops.paged_decode_attention(q[:nd], k_cache, v_cache, d.block_tables,
                                           d.seq_lens, scale, **kv)
        return torch.cat((out_d, out_p))
