"""Shared host-side helpers: triton import, interpreter detection, argument checks."""

from __future__ import annotations

import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # caches only, with per-layer scales


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (TRITON_INTERPRET set)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_tensor(name: str, t, ndim: int, dtypes=SUPPORTED_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {names}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, "
                         f"got strides {t.stride()}")


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like the query/keys")
    if device.type == "cpu" and not interpreting():
        raise ValueError("CPU tensors need the triton interpreter: set TRITON_INTERPRET=1 "
                         "before triton is imported, or pass CUDA tensors")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; expected cuda (or cpu with "
                         "TRITON_INTERPRET=1)")


def check_kv_cache(k_cache, v_cache) -> tuple[int, int, int, int]:
    """Validate a ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache pair."""
    check_tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES + FP8_DTYPES)
    check_tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES + FP8_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} and v_cache strides "
                         f"{v_cache.stride()} must match")
    check_last_dim_contiguous("k_cache", k_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(f"empty cache dimensions in shape {tuple(k_cache.shape)}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_attention_common(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """Checks shared by decode and prefill; returns (block_size, num_kv_heads, head_dim)."""
    check_tensor("q", q, 3)
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.dtype != k_cache.dtype and k_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    check_last_dim_contiguous("q", q)
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_last_dim_contiguous("block_tables", block_tables)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has "
                         f"{seq_lens.shape[0]} entries")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale must be a Python float, got {type(scale).__name__}")
    check_same_device(q.device, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens)
    return block_size, num_kv_heads, head_dim
