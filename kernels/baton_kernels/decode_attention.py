"""paged_decode_attention: one query token per sequence over a paged KV cache, with split-K.

Stage 1 (``paged_decode_split_kernel``), grid ``(batch, kv_heads, num_splits)``: each program
takes the query heads that share one KV head (GQA group, padded to 16 rows for ``tl.dot``) and
one chunk of its sequence's *live* keys, gathers K/V through the block table and runs an
online softmax with fp32 accumulation. The chunk comes from the sequence's own length, read
on the device (`split_range`): the live keys (the last ``sliding_window`` of them with a
window) cut into ``num_splits`` equal chunks rounded up to whole tiles, so the splits share
the work whatever the block table's width (inside a CUDA graph the table is
``max_model_len / block_size`` wide; a short context still spreads over every split). With
one split it writes the final output; otherwise each split writes its normalised output and
log-sum-exp (a split with no keys only writes an lse of -inf and stops), and stage 2
(``paged_decode_reduce_kernel``) combines them weighted by ``exp(lse - max lse)``.

``num_splits`` is a runtime argument from ``SPLIT_COUNTS``: one compiled variant serves every
split count, batch size and context length.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from baton_kernels._common import check_attention_common, interpreting, next_pow2
from baton_kernels._tiles import (
    LOG2E,
    NO_WINDOW,
    load_kv_tile,
    loop_bound,
    online_softmax_step,
    softcap_args,
)
from baton_kernels._variants import jit

SPLIT_COUNTS = (1, 2, 4, 8, 16, 32)  # what `choose_num_splits` picks from
MAX_SPLITS = SPLIT_COUNTS[-1]
MIN_CHUNK_TOKENS = 256  # a context the host knows is not cut into chunks smaller than this


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_range(seq_len: int, window: int, split: int, num_splits: int, block_n: int
                ) -> tuple[int, int]:
    """Key positions ``[start, end)`` that split ``split`` of ``num_splits`` reads for a
    sequence of ``seq_len`` cached tokens whose query sees its last ``window`` keys: the live
    keys cut into equal chunks rounded up to whole tiles of ``block_n``; empty (start >= end)
    for splits past the last key. The kernel computes the same with `_split_range`."""
    first = max(seq_len - window, 0)
    chunk = cdiv(cdiv(seq_len - first, num_splits), block_n) * block_n
    start = first + split * chunk
    return start, min(start + chunk, seq_len)


@triton.jit
def _split_range(seq_len, window, split, num_splits, BLOCK_N: tl.constexpr):
    """`split_range` on the device, line for line."""
    first = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@jit(dynamic=("window", "num_splits", "stride_bt"),
     unaligned=("block_tables_ptr", "seq_lens_ptr"))
def paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, v_scale, cap_in, cap_out, window, num_splits, block_size,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = _split_range(seq_len, window, split, num_splits, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_mask = g_mask[:, None] & d_mask[None, :]
    row = (b.to(tl.int64) * NUM_HEADS + heads) * num_splits + split      # partials' rows
    if (num_splits > 1) & (start >= end):  # no key here: the reduce skips an lse of -inf
        tl.store(part_lse_ptr + row, tl.full([BLOCK_G], float("-inf"), tl.float32),
                 mask=g_mask)
    else:
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        for n0 in range(loop_bound(start), loop_bound(end), BLOCK_N):
            pos = n0 + offs_n
            n_mask = pos < end
            kt, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, n_mask, offs_d,
                                 d_mask, kvh, block_size, stride_cb, stride_cs, stride_ch)
            m_i, l_i, acc = online_softmax_step(q, kt, v, n_mask[None, :], m_i, l_i, acc,
                                                qk_scale, cap_in, cap_out, DOT_FP32, SOFTCAP)
        has_keys = l_i > 0
        result = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
        if num_splits == 1:
            o_ptrs = (out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                      + offs_d[None, :])
            tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], result,
                     mask=q_mask)
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)),
                           float("-inf"))
            tl.store(part_lse_ptr + row, lse, mask=g_mask)


@jit(dynamic=("num_rows", "num_splits"))
def paged_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_rows, num_splits,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine the per-split outputs of ROWS (sequence, head) rows; out is contiguous
    [B, H, D]. A split with an lse of -inf read no key and wrote no output: it is skipped."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = rows < num_rows
    rs_mask = r_mask[:, None] & (offs_s < num_splits)[None, :]
    rows64 = rows.to(tl.int64)
    lse = tl.load(part_lse_ptr + rows64[:, None] * num_splits + offs_s[None, :],
                  mask=rs_mask, other=float("-inf"))                          # [R, S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    denom = tl.where(denom > 0, denom, 1.0)
    written = rs_mask & (lse > float("-inf"))
    mask3 = written[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    o_ptrs = (part_out_ptr + (rows64[:, None, None] * num_splits + offs_s[None, :, None])
              * HEAD_DIM + offs_d[None, None, :])
    o = tl.load(o_ptrs, mask=mask3, other=0.0)                                # [R, S, D]
    res = tl.sum(o * w[:, :, None], 1) / denom[:, None]
    out_mask = r_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(out_ptr + rows64[:, None] * HEAD_DIM + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    """Programs that keep a device busy: two per SM on CUDA; 8 in the interpreter, where
    every program costs ~7 ms."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int,
                      device: torch.device) -> int:
    """The largest of SPLIT_COUNTS that neither overfills the device (batch x kv heads x
    splits programs against two per SM) nor cuts ``max_context`` tokens into chunks smaller
    than MIN_CHUNK_TOKENS. ``max_context`` is a host-side bound: the live longest context
    when the host knows it, else the block table's reach (inside a CUDA graph: the model's
    max length, so the choice is by occupancy only and the kernel spreads the live keys)."""
    by_length = max(1, cdiv(max_context, MIN_CHUNK_TOKENS))
    by_occupancy = cdiv(_target_programs(device), max(1, batch * num_kv_heads))
    bound = min(by_length, by_occupancy)
    return max(s for s in SPLIT_COUNTS if s <= bound)


def decode_block_n(block_size: int) -> int:
    """Keys per loop step (a power of two holding at least one page)."""
    return max(next_pow2(block_size), 128 if interpreting() else 64)


def decode_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    num_splits: int, *, k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None, softcap: float | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 alone, arguments checked: ``(out, part_out, part_lse)``. With one split
    ``out [B, H, D]`` is the answer; otherwise ``part_out [B * H * S, D]`` (fp32) and
    ``part_lse [B * H * S]`` (log2 units, -inf for a split with no key) hold each split's
    result, row ``(b * H + h) * S + split``, and ``out`` is still to be written."""
    _check_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    return _split_stage(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits,
                        k_scale, v_scale, sliding_window, softcap)


def _check_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits) -> None:
    check_attention_common(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for a batch of "
                         f"{q.shape[0]}")
    if num_splits is not None and (not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")


def _split_stage(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scale,
                 v_scale, sliding_window, softcap):
    """Launch stage 1 (arguments already checked); see `decode_partials`."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    rows = batch * num_heads * num_splits if num_splits > 1 else 1  # 1: an unused placeholder
    part_out = torch.empty((rows, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((rows,), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, part_out, part_lse
    group = num_heads // num_kv_heads
    interp = interpreting()
    cap_in, cap_out = softcap_args(float(scale) * float(k_scale), softcap)
    paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        float(scale) * float(k_scale) * LOG2E, float(v_scale), cap_in, cap_out,
        int(sliding_window or NO_WINDOW), num_splits, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=decode_block_n(block_size), DOT_FP32=interp or q.dtype == torch.float32,
        SOFTCAP=softcap is not None, num_warps=4,
    )
    return out, part_out, part_lse


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           *, num_splits: int | None = None, max_seq_len: int | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           sliding_window: int | None = None, softcap: float | None = None
                           ) -> torch.Tensor:
    """Attention of ``q [B, H, D]`` (one token per sequence) over its paged context: the
    last ``sliding_window`` keys when given, scores soft-capped by ``softcap`` when given.

    The caches hold q's dtype, or FP8 read as ``stored * k_scale`` / ``stored * v_scale``.

    ``block_tables [B, max_blocks]`` int32 maps logical to physical blocks, ``seq_lens [B]``
    int32 counts cached tokens (0: a padding row, output zero). Each sequence's keys are
    split by its own length on the device. ``num_splits`` (1 .. MAX_SPLITS; None: chosen
    by `choose_num_splits` from ``max_seq_len``, the longest context if the caller knows
    it on the host, else ``max_blocks * block_size``) fixes the grid, so a CUDA graph
    captures one launch that fits every live length.
    """
    _check_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    batch, num_heads, head_dim = q.shape
    if num_splits is None:
        bound = (max_seq_len if max_seq_len is not None
                 else block_tables.shape[1] * k_cache.shape[1])
        num_splits = choose_num_splits(batch, k_cache.shape[2], bound, q.device)
    out, part_out, part_lse = _split_stage(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                           num_splits, k_scale, v_scale, sliding_window,
                                           softcap)
    if batch and num_splits > 1:
        rows = batch * num_heads
        rows_per_program = 16 if interpreting() else 1
        paged_decode_reduce_kernel[(triton.cdiv(rows, rows_per_program),)](
            part_out, part_lse, out, rows, num_splits,
            HEAD_DIM=head_dim, ROWS=rows_per_program, BLOCK_S=MAX_SPLITS,
            BLOCK_D=max(16, next_pow2(head_dim)), num_warps=4,
        )
    return out
