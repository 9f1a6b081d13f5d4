"""paged_prefill_attention: causal attention for new tokens over a paged KV cache (Triton).

Grid ``(num_q_tiles, kv_heads)``. A tile holds BLOCK_Q consecutive query tokens of one sequence
times the GROUP query heads that share a KV head (rows = token * GROUP + head), so each K/V tile
loaded through the block table serves the whole GQA group. Tile ``i`` belongs to the sequence
``b`` with the largest ``query_start_loc[b] // BLOCK_Q + b <= i``; that bound makes
``T // BLOCK_Q + B`` tiles always enough without reading lengths on the host. Tiles past the
end of their sequence do nothing. The search walks the batch BLOCK_B sequences at a time, so
one compiled variant serves every batch size (`_variants`).
"""

from __future__ import annotations

import torch
import triton.language as tl

from baton_kernels._common import check_attention_common, check_tensor, interpreting, next_pow2
from baton_kernels._tiles import (
    LOG2E,
    NO_WINDOW,
    load_kv_tile,
    loop_bound,
    online_softmax_step,
    softcap_args,
)
from baton_kernels._variants import jit

BLOCK_B = 64  # sequences per step of the tile -> sequence search


@jit(dynamic=("window", "num_seqs", "stride_bt"),
     unaligned=("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"))
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, qk_scale, v_scale, cap_in, cap_out, window, num_seqs, block_size,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)

    # Which sequence does this tile belong to: count the sequences whose first tile is at or
    # before it, BLOCK_B of them per step.
    count = tl.zeros([], dtype=tl.int32)
    for b0 in range(0, loop_bound(num_seqs), BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        b_mask = offs_b < num_seqs
        starts = tl.load(query_start_loc_ptr + offs_b, mask=b_mask, other=0)
        first_tile = starts // BLOCK_Q + offs_b
        count += tl.sum(tl.where(b_mask & (first_tile <= tile), 1, 0), 0)
    b = tl.maximum(count - 1, 0)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    j = tile - (q_start // BLOCK_Q + b)
    if (j >= 0) & (j * BLOCK_Q < q_len):
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_len = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        q_idx = j * BLOCK_Q + offs_m // GROUP              # query index within the sequence
        heads = kvh * GROUP + offs_m % GROUP
        row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
        d_mask = offs_d < HEAD_DIM
        qd_mask = row_mask[:, None] & d_mask[None, :]
        tok = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=qd_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = ctx_len + q_idx                             # absolute position of each row

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        kv_end = tl.minimum(seq_len, ctx_len + (j + 1) * BLOCK_Q)
        # The tile's first row (position ctx_len + j * BLOCK_Q) sees the earliest key.
        kv_start = tl.maximum(ctx_len + j * BLOCK_Q - window + 1, 0)
        for n0 in range(loop_bound(kv_start), loop_bound(kv_end), BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < kv_end
            kt, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, n_mask, offs_d,
                                 d_mask, kvh, block_size, stride_cb, stride_cs, stride_ch)
            visible = (n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
                       & (pos[None, :] > q_pos[:, None] - window))
            m_i, l_i, acc = online_softmax_step(q, kt, v, visible, m_i, l_i, acc, qk_scale,
                                                cap_in, cap_out, DOT_FP32, SOFTCAP)

        result = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=qd_mask)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *, k_scale: float = 1.0,
                            v_scale: float = 1.0, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` (the last query_len tokens of each sequence); a
    query at position i sees keys i - sliding_window < j <= i when a window is given, scores
    soft-capped by ``softcap`` when given.

    The caches hold q's dtype, or FP8 read as ``stored * k_scale`` / ``stored * v_scale``.

    ``query_start_loc [B+1]`` int32 (starting at 0) delimits each sequence's queries in ``q``;
    ``seq_lens [B]`` int32 counts all cached tokens including the queries' own K/V.
    """
    block_size, num_kv_heads, head_dim = check_attention_common(
        q, k_cache, v_cache, block_tables, seq_lens, scale)
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    if not query_start_loc.is_contiguous():
        raise ValueError("query_start_loc must be contiguous")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries; expected "
                         f"num_seqs + 1 = {num_seqs + 1}")
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device}, expected {q.device}")
    num_tokens, num_heads, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    interp = interpreting()
    block_m = max(next_pow2(group), 128 if interp else 64)
    block_q = block_m // group
    block_n = max(next_pow2(block_size), 128 if interp else 64)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    cap_in, cap_out = softcap_args(float(scale) * float(k_scale), softcap)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        float(scale) * float(k_scale) * LOG2E, float(v_scale), cap_in, cap_out,
        int(sliding_window or NO_WINDOW), num_seqs, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_B=BLOCK_B, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=block_n, DOT_FP32=interp or q.dtype == torch.float32,
        SOFTCAP=softcap is not None, num_warps=4,
    )
    return out
