"""reshape_and_cache: scatter new keys/values into the paged KV cache (Triton).

An FP8 cache stores x / scale saturated to the format's largest value. The kernel builds the
format's bytes itself (rounded to nearest, ties to even, bit-exact against torch's cast,
the sign of a zero kept) and writes the cache as bytes: Triton's interpreter rounds some
values wrongly across a power of two in its cast, and its FP8 stores are unreliable. The token tile is fixed by the cache's
shape, not the step's token count, so one compiled variant serves every step (`_variants`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels._common import (
    FP8_DTYPES,
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    interpreting,
    next_pow2,
)
from baton_kernels._variants import jit

# FP8 dtype -> (mantissa bits, smallest normal exponent)
_FP8 = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _to_fp8_bytes(x, scale, fp8_max, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """x / scale (IEEE division, as torch's), saturated and rounded to the FP8 grid (nearest,
    ties to even), as the format's bytes, put together from the bits: sign, then the count
    of the value's quanta over its exponent's first (so a rounding up to the next power of
    two carries into the exponent). No float-to-FP8 cast: the interpreter's rounds some
    values wrongly, and a value that rounds to zero keeps its sign (-0, as torch gives)."""
    x = tl.math.div_rn(x.to(tl.float32), scale)
    nan = x != x
    x = tl.minimum(tl.maximum(x, -fp8_max), fp8_max)
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP)  # subnormals share the smallest normal's quantum
    per_quantum = ((127 + MANTISSA - exp) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(x) * per_quantum  # exact (a power of two), < 2^(MANTISSA + 1)
    y = (y + 12582912.0) - 12582912.0  # round to nearest even (1.5 * 2^23)
    magnitude = ((exp - MIN_EXP) << MANTISSA) + y.to(tl.int32)
    magnitude = tl.where(nan, 0x7F, magnitude)
    return (magnitude | ((bits >> 24) & 0x80)).to(tl.uint8)


@jit(dynamic=("num_tokens",), unaligned=("slot_ptr",))
def reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_tokens, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, k_scale, v_scale, fp8_max,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    FP8: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):
    """Each program copies BLOCK_T tokens; a row is all KV heads of one token (flattened)."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=-1).to(tl.int64)
    valid = t_mask & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    block = slot // block_size
    offset = slot % block_size

    offs_hd = tl.arange(0, BLOCK_HD)
    head = offs_hd // HEAD_DIM
    dim = offs_hd % HEAD_DIM
    mask = valid[:, None] & (offs_hd < NUM_KV_HEADS * HEAD_DIM)[None, :]

    tok = offs_t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + tok * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    dst = (block[:, None] * stride_cb + offset[:, None] * stride_cs
           + head[None, :] * stride_ch + dim[None, :])
    if FP8:  # caches passed as their bytes
        k = _to_fp8_bytes(k, k_scale, fp8_max, MANTISSA, MIN_EXP)
        v = _to_fp8_bytes(v, v_scale, fp8_max, MANTISSA, MIN_EXP)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``k/v [T, KVH, D]`` into the caches at ``slot_mapping [T]`` (negative = skip).

    Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block *
    block_size + offset. An FP8 cache stores ``k / k_scale`` and ``v / v_scale``, saturated;
    other caches take k/v of their own dtype as they are. Modifies ``k_cache``/``v_cache``
    in place.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("k", k, 3)
    check_tensor("v", v, 3)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k/v are [T, {k.shape[1]}, {k.shape[2]}] but the cache holds "
                         f"{num_kv_heads} KV heads of dim {head_dim}")
    fp8 = k_cache.dtype in FP8_DTYPES
    if k.dtype != v.dtype or (not fp8 and k.dtype != k_cache.dtype):
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differs from cache dtype "
                         f"{k_cache.dtype}")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"k_scale / v_scale must be > 0, got {k_scale} / {v_scale}")
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{k.shape[0]} tokens")
    check_same_device(k.device, v=v, k_cache=k_cache, v_cache=v_cache,
                      slot_mapping=slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    block_hd = next_pow2(num_kv_heads * head_dim)
    budget = 1 << 16 if interpreting() else 4096
    block_t = max(1, budget // block_hd)
    grid = (triton.cdiv(num_tokens, block_t),)
    mantissa, min_exp = _FP8.get(k_cache.dtype, (0, 0))
    reshape_and_cache_kernel[grid](
        k, v, k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache, slot_mapping,
        num_tokens, block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        float(k_scale), float(v_scale), torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_HD=block_hd,
        FP8=fp8, MANTISSA=mantissa, MIN_EXP=min_exp, num_warps=4,
    )
