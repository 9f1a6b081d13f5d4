"""W4A16 / W8A16: ``y = x @ w.T`` with integer weights de-quantized in registers (Triton).

x ``[M, K]`` bf16 or fp16; w from `quant_pack.pack_int_weight` (int32 ``[K * bits / 32, N]``)
with scales ``[N, G]`` (fp16 / bf16 / fp32) and zeros (uint8 ``[N, G]`` or None); the formula
is `quant_reference`'s. Each step of a program reads a ``BLOCK_K / (32 / bits) x BLOCK_N``
tile of words, shifts the codes out (``[BLOCK_K, BLOCK_N]``), and feeds a tensor-core dot in
x's dtype with float32 accumulation. When the K tile lies in one group (``group_size`` a
multiple of BLOCK_K, or a single group), the dot takes ``codes - zero`` (small integers,
exact in bf16 and fp16) and the group's scale multiplies the dot's result: one multiply per
output, not per weight. Otherwise (act-order ``g_idx``, small or odd group sizes) each row
of the tile gathers its own group's scales and zeros and the de-quantized tile is rounded to
x's dtype before the dot. Row-count buckets and split-K: `_gemm`.

Variants: M, the split count and its tile count are not specialised; the rest (bits, zeros
or not, g_idx or not, the bucket's tiles, the shape) is the model's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels._common import (
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    interpreting,
)
from baton_kernels._gemm import (
    finish,
    split_k,
    split_output,
    split_range,
    store_tile,
    tile_coordinates,
    tile_dot,
    tiles_for,
)
from baton_kernels._variants import jit
from baton_kernels.quant_pack import codes_per_word

ACT_DTYPES = (torch.float16, torch.bfloat16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _unpack_codes(w_ptr, k0, offs_n, N, K, stride_wk, BITS: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The codes of rows k0 .. k0 + BLOCK_K (0 past K) of columns offs_n: int32
    ``[BLOCK_K, BLOCK_N]``."""
    PER_WORD: tl.constexpr = 32 // BITS
    offs_p = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    mask = (offs_p < K // PER_WORD)[:, None] & (offs_n < N)[None, :]
    words = tl.load(w_ptr + offs_p[:, None] * stride_wk + offs_n[None, :], mask=mask,
                    other=0)                                              # (BK / P, BN)
    shifts = tl.arange(0, PER_WORD) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # (BK/P, P, BN)
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@jit(dynamic=("M", "tiles_per_split", "stride_ys"))
def int_weight_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, group_size, tiles_per_split,
    stride_xm, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, stride_ym, stride_ys,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, ACT_ORDER: tl.constexpr,
    ROW_GROUPS: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of y over this split's K tiles (`_gemm`)."""
    offs_m, offs_n = tile_coordinates(M, N, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first, last = split_range(K, tiles_per_split, BLOCK_K)
    for t in range(first, last):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)     # (BM, BK)
        codes = _unpack_codes(w_ptr, k0, offs_n, N, K, stride_wk, BITS, BLOCK_K, BLOCK_N)
        if ROW_GROUPS:  # each row its own group: gather [BK, BN] scales (and zeros)
            if ACT_ORDER:
                g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
            else:
                g = offs_k // group_size
            gmask = k_mask[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                        mask=gmask, other=0.0).to(tl.float32)              # (BK, BN)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                            mask=gmask, other=0).to(tl.int32)
            else:
                z = 1 << (BITS - 1)
            w = (codes - z).to(tl.float32) * s
            if not DOT_FP32:
                w = w.to(x.dtype)
            acc = tile_dot(x, w, acc, DOT_FP32)
        else:  # the tile is in one group: scale the dot's result, not the weights
            g = k0 // group_size
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask,
                        other=0.0).to(tl.float32)                          # (BN,)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=n_mask,
                            other=0).to(tl.int32)[None, :]
            else:
                z = 1 << (BITS - 1)
            # codes - z: small integers, exact in x's dtype (via float32: the interpreter's
            # int -> bf16 cast is wrong)
            w = (codes - z).to(tl.float32).to(x.dtype)
            acc += tile_dot(x, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                            DOT_FP32) * s[None, :]
    store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, stride_ys, SPLIT)


def _check_int_args(x, packed, scales, zeros, g_idx, group_size, bits, n, k) -> int:
    """ValueError naming what does not fit; returns G (groups along K)."""
    per_word = codes_per_word(bits)
    check_tensor("x", x, 2, ACT_DTYPES)
    check_last_dim_contiguous("x", x)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if k % per_word:
        raise ValueError(f"K = {k} is not a multiple of {per_word}: int{bits} weights pack "
                         f"{per_word} codes per int32 along K")
    check_tensor("packed", packed, 2, (torch.int32,))
    if tuple(packed.shape) != (k // per_word, n) or not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous int32 [{k // per_word}, {n}] "
                         f"(pack_int_weight of [N={n}, K={k}]), got {tuple(packed.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight's K is {k}")
    check_tensor("scales", scales, 2, SCALE_DTYPES)
    # act-order: g_idx names each column's group, so any G (a row-parallel rank's share of
    # the columns keeps every group of the checkpoint's weight); else one per group_size run
    groups = scales.shape[1] if g_idx is not None else -(-k // group_size)
    if tuple(scales.shape) != (n, groups):
        raise ValueError(f"scales must be [N={n}, G={groups}], got {tuple(scales.shape)}")
    if zeros is not None:
        check_tensor("zeros", zeros, 2, (torch.uint8,))
        if tuple(zeros.shape) != (n, groups):
            raise ValueError(f"zeros must be [N={n}, G={groups}], got {tuple(zeros.shape)}")
    if g_idx is not None:
        check_tensor("g_idx", g_idx, 1, (torch.int32,))
        if g_idx.shape[0] != k or not g_idx.is_contiguous():
            raise ValueError(f"g_idx must be contiguous int32 [K={k}], got "
                             f"{tuple(g_idx.shape)}")
    check_same_device(x.device, packed=packed, scales=scales,
                      **({"zeros": zeros} if zeros is not None else {}),
                      **({"g_idx": g_idx} if g_idx is not None else {}))
    return groups


def int_weight_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None, g_idx: torch.Tensor | None, group_size: int,
                    bits: int, n: int, k: int) -> torch.Tensor:
    """``y [M, N] = x [M, K] @ w.T`` in x's dtype (bf16 / fp16), w the integer weight of
    `quant_reference` packed by `pack_int_weight` (bits 4 or 8). scales ``[N, G]``, zeros
    uint8 ``[N, G]`` or None (symmetric), ``G = ceil(K / group_size)`` (``group_size >= K``:
    per channel; with g_idx any G, e.g. a row-parallel rank's columns); any strides, fastest `group_major`. g_idx int32 ``[K]`` only for act-order
    (GPTQ checkpoints without it carry ``g_idx == k // group_size``: pass None, the faster
    path); its values must lie in ``[0, G)`` (not checked: that would sync the device).
    ValueError for arguments that do not fit; CUDA tensors, or CPU under TRITON_INTERPRET."""
    groups = _check_int_args(x, packed, scales, zeros, g_idx, group_size, bits, n, k)
    m = x.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    tiles = tiles_for(m)
    block_k = tiles.block_k
    group_size = min(group_size, k)  # one group: every tile is inside it
    if groups > 1 and g_idx is None and group_size % block_k:
        if group_size >= 16 and group_size & (group_size - 1) == 0:
            block_k = group_size  # a power of two below the tile: tiles of one group
    row_groups = g_idx is not None or (groups > 1 and group_size % block_k != 0)
    splits, per_split = split_k(tiles, m, n, triton.cdiv(k, block_k), x.device)
    out = split_output(splits, m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), splits)
    int_weight_gemm_kernel[grid](
        x, packed, scales, zeros if zeros is not None else scales,
        g_idx if g_idx is not None else packed, out,
        m, n, k, group_size, per_split,
        x.stride(0), packed.stride(0), scales.stride(0), scales.stride(1),
        zeros.stride(0) if zeros is not None else 0, zeros.stride(1) if zeros is not None else 0,
        out.stride(-2), out.stride(0) if splits > 1 else 0,
        BITS=bits, HAS_ZEROS=zeros is not None, ACT_ORDER=g_idx is not None,
        ROW_GROUPS=row_groups, SPLIT=splits > 1, DOT_FP32=interpreting(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        num_warps=tiles.num_warps)
    return finish(out, x.dtype)
