"""paged_decode_attention: one query token per sequence over a paged KV cache, with split-K.

Stage 1 (``paged_decode_split_kernel``), grid ``(batch, kv_heads, splits)``: each program takes
the query heads that share one KV head (GQA group, padded to 16 rows for ``tl.dot``) and one
contiguous chunk of the context, gathers K/V through the block table and runs an online softmax
with fp32 accumulation. With one split it writes the final output; otherwise it writes the
chunk's normalised output and log-sum-exp, and stage 2 (``paged_decode_reduce_kernel``)
combines the chunks weighted by ``exp(lse - max lse)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels._common import check_attention_common, interpreting, next_pow2
from baton_kernels._tiles import (LOG2E, NO_WINDOW, load_kv_tile, online_softmax_step,
                                  softcap_args)
MIN_CHUNK_TOKENS = 256   # never split a context into chunks smaller than this
MAX_SPLITS = 32


@triton.jit
def paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, v_scale, cap_in, cap_out, window, block_size, chunk_size,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # The query sits at seq_len - 1 and sees keys seq_len - window .. seq_len - 1.
    start = tl.maximum(split * chunk_size, seq_len - window)
    end = tl.minimum(start + chunk_size, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
                + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        kt, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, n_mask, offs_d, d_mask,
                             kvh, block_size, stride_cb, stride_cs, stride_ch)
        m_i, l_i, acc = online_softmax_step(q, kt, v, n_mask[None, :], m_i, l_i, acc,
                                            qk_scale, cap_in, cap_out, DOT_FP32, SOFTCAP)

    has_keys = l_i > 0
    result = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], result, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def paged_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_rows,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine per-chunk outputs of ROWS (sequence, head) rows; out is contiguous [B, H, D]."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = rows < num_rows
    rs_mask = r_mask[:, None] & (offs_s < NUM_SPLITS)[None, :]
    rows64 = rows.to(tl.int64)
    lse = tl.load(part_lse_ptr + rows64[:, None] * NUM_SPLITS + offs_s[None, :],
                  mask=rs_mask, other=float("-inf"))                          # [R, S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    denom = tl.where(denom > 0, denom, 1.0)
    mask3 = rs_mask[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    o_ptrs = (part_out_ptr + (rows64[:, None, None] * NUM_SPLITS + offs_s[None, :, None])
              * HEAD_DIM + offs_d[None, None, :])
    o = tl.load(o_ptrs, mask=mask3, other=0.0)                                # [R, S, D]
    res = tl.sum(o * w[:, :, None], 1) / denom[:, None]
    out_mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(out_ptr + rows64[:, None] * HEAD_DIM + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=out_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                      block_n: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, never chunks < MIN_CHUNK_TOKENS."""
    by_length = triton.cdiv(max_context, max(MIN_CHUNK_TOKENS, block_n))
    if device.type == "cuda":
        target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target_programs = 8   # interpreter: every program costs ~7 ms
    by_occupancy = triton.cdiv(target_programs, max(1, batch * num_kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           *, num_splits: int | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, sliding_window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q [B, H, D]`` (one token per sequence) over its paged context: the
    last ``sliding_window`` keys when given, scores soft-capped by ``softcap`` when given.

    The caches hold q's dtype, or FP8 read as ``stored * k_scale`` / ``stored * v_scale``.

    ``block_tables [B, max_blocks]`` int32 maps logical to physical blocks, ``seq_lens [B]``
    int32 counts cached tokens. The context bound used to pick ``num_splits`` is
    ``max_blocks * block_size`` (no device-to-host sync); pass ``num_splits`` to override.
    """
    block_size, num_kv_heads, head_dim = check_attention_common(
        q, k_cache, v_cache, block_tables, seq_lens, scale)
    batch, num_heads, _ = q.shape
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for a batch of {batch}")
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    interp = interpreting()
    block_n = max(next_pow2(block_size), 128 if interp else 64)
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, q.device, block_n)
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    chunk = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_context, chunk))

    if num_splits > 1:
        part_out = torch.empty((batch * num_heads * num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((batch * num_heads * num_splits,), dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out   # unused by the kernel when NUM_SPLITS == 1
    block_d = max(16, next_pow2(head_dim))
    cap_in, cap_out = softcap_args(float(scale) * float(k_scale), softcap)
    paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        float(scale) * float(k_scale) * LOG2E, float(v_scale), cap_in, cap_out,
        int(sliding_window or NO_WINDOW), block_size, chunk,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_FP32=interp or q.dtype == torch.float32, SOFTCAP=softcap is not None,
        num_warps=4,
    )
    if num_splits > 1:
        rows = batch * num_heads
        rows_per_program = 16 if interp else 1
        paged_decode_reduce_kernel[(triton.cdiv(rows, rows_per_program),)](
            part_out, part_lse, out, rows,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            ROWS=rows_per_program, BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d,
            num_warps=4,
        )
    return out
