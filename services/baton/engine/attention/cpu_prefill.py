"""A C kernel for paged prefill attention on CPU (built by `baton.engine.native`).

Why: the torch prefill path (`torch_backend._prefill_attention`) makes bf16 score matrices,
converts them to fp32, adds a (Q, L) mask, softmaxes and converts back: several memory
passes over Q x L x H values plus a gather of the cached K/V, ~10x the time its FLOPs need.
The kernel is flash-attention style: online softmax in fp32 over key tiles read in place from
the pages, every prefill chunk of the step in one call. When it cannot be built, `load()`
returns None and the backend keeps the torch path (also the tests' reference).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from baton.engine.attention.kv_quant import fp8_table, is_fp8
from baton.engine.native import load_library

_SOURCE = Path(__file__).parent / "csrc" / "paged_prefill.c"


class NativePrefillAttention:
    SPECIALISED_HEAD_DIMS = (64, 128)  # compile-time kernels; others take the generic one

    def __init__(self, lib: ctypes.CDLL) -> None:
        # bf16 x bf16 -> fp32 dot-product instructions (AVX512-BF16) where the build has them;
        # False takes the fp32 FMA path (tests compare both).
        self.has_bf16_dot = bool(lib.paged_prefill_has_bf16_dot())
        self.use_bf16_dot = self.has_bf16_dot
        # (query dtype, FP8 cache) -> the kernels' name stem
        stems = {(torch.float32, False): "f32", (torch.bfloat16, False): "bf16",
                 (torch.float32, True): "fp8_f32", (torch.bfloat16, True): "fp8_bf16"}
        # (dtype, fp8, head dim) -> kernel; (dtype, fp8, 0) is the generic one.
        self._fns = {(dt, fp8, d): getattr(lib, f"paged_prefill_{stem}" + (f"_d{d}" if d else ""))
                     for (dt, fp8), stem in stems.items()
                     for d in (0, *self.SPECIALISED_HEAD_DIMS)}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                           + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                           + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]
                           + [ctypes.c_float, ctypes.c_void_p])
        self._tables = {dt: fp8_table(dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
        return ((dtype, False, 0) in self._fns and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= 16 and head_dim <= 256 and head_dim % 16 == 0)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seqs: torch.Tensor, scale: float,
                 out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """q/out (T, H, D) with contiguous rows (any row stride); caches (blocks, bs, KVH, D)
        contiguous in q's dtype or FP8 (read as stored x k_scale / v_scale), already holding
        the chunks' own K/V; block_tables (n, m) int64 with unit
        column stride, row i for prefill sequence i; seqs (n, 3) int64 contiguous: per
        sequence its first row in q, its query count and its cached context length. Writes
        the sequences' rows of `out`."""
        T, H, D = q.shape
        bs, KVH = k_cache.shape[1], k_cache.shape[2]
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        if block_tables.dtype != torch.int64 or block_tables.stride(1) != 1:
            raise ValueError("block_tables must be int64 with unit column stride, got "
                             f"{block_tables.dtype} with strides {block_tables.stride()}")
        if out.stride(2) != 1 or out.stride(1) != D or out.dtype != q.dtype:
            raise ValueError(f"out must be {q.dtype} with contiguous rows, got {out.dtype} "
                             f"with strides {out.stride()}")
        fp8 = is_fp8(k_cache.dtype)
        table = self._tables[k_cache.dtype].data_ptr() if fp8 else None
        fn = self._fns.get((q.dtype, fp8, D)) or self._fns[(q.dtype, fp8, 0)]
        rc = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seqs.data_ptr(), out.data_ptr(),
            out.stride(0), seqs.shape[0], H, KVH, D, bs, scale * k_scale,
            int(self.use_bf16_dot), v_scale, table)
        if rc != 0:
            raise RuntimeError(f"native paged prefill attention failed (code {rc})")


def load(cache_dir: Path) -> NativePrefillAttention | None:
    """Build (once per source version) and load the kernel; None if it cannot be built."""
    lib = load_library(_SOURCE, cache_dir)
    return None if lib is None else NativePrefillAttention(lib)
