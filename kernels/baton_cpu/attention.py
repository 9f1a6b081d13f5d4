"""Paged attention on CPU in C: decode (`csrc/paged_decode.c`) and prefill
(`csrc/paged_prefill.c`), each reading the cache's pages in place. Caches are (blocks,
block_size, KVH, D) in the query's dtype, or FP8 read through a table of the format's values
(`fp8_table`) times the layer's k / v scale. The torch attention backend's own paths are
their reference in the tests; without a compiler the backend runs those.

Decode. Why: gathering every sequence's pages and calling SDPA spends most of a large decode
step copying K/V and padding (measured ~2.5 ms per layer at 64 sequences x 300 tokens). One
task per sequence, pages prefetched.

Prefill. Why: the torch prefill path makes bf16 score matrices, converts them to fp32, adds a
(Q, L) mask, softmaxes and converts back: several memory passes over Q x L x H values plus a
gather of the cached K/V, ~10x the time its FLOPs need. The kernel is flash-attention style:
online softmax in fp32 over key tiles read in place from the pages, every prefill chunk of the
step in one call, register blocks sized for the target's vector width (AVX-512 or AVX2).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton_cpu.build import load_library

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr (typeshed's only public name)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """(256,) float32: the value of each byte of the FP8 format `dtype` (what the C kernels
    index with the stored byte)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


class NativeDecodeAttention:
    # (query heads per kv head, head dim) with compile-time specialised kernels.
    SPECIALISED = ((1, 64), (2, 64), (3, 64), (4, 64), (1, 128), (2, 128), (4, 128), (5, 128),
                   (7, 128), (8, 128))
    # (query dtype, whether the cache is FP8) -> the kernels' name stem
    _STEMS = {(torch.float32, False): "f32", (torch.bfloat16, False): "bf16",
              (torch.float32, True): "fp8_f32", (torch.bfloat16, True): "fp8_bf16"}

    def __init__(self, lib: ctypes.CDLL) -> None:
        # (dtype, fp8, G, D) -> kernel; (dtype, fp8, 0, 0) is the generic one; FP8 caches
        # only with bf16 queries have specialisations.
        self._fns = {(dt, fp8, 0, 0): getattr(lib, f"paged_decode_{stem}")
                     for (dt, fp8), stem in self._STEMS.items()}
        self._fns.update({(dt, fp8, g, d): getattr(lib, f"paged_decode_{stem}_g{g}_d{d}")
                          for (dt, fp8), stem in self._STEMS.items()
                          if stem != "fp8_f32" for g, d in self.SPECIALISED})
        common = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] \
            + [ctypes.c_int64] * 5 + [ctypes.c_float]
        for (_, fp8, _, _), fn in self._fns.items():
            fn.restype = ctypes.c_int
            fn.argtypes = common + ([ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
                                    if fp8 else [])
        self._tables = {dt: fp8_table(dt) for dt in FP8}

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
        return ((dtype, False, 0, 0) in self._fns and head_dim <= 256
                and num_heads // num_kv_heads <= 16)

    def kernel(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               head_dim: int, fp8: bool = False) -> CFuncPtr:
        """The C function for these shapes: a specialised one, else the generic one. Those
        for FP8 caches take three more arguments (v_scale, the byte table, e4m3)."""
        return (self._fns.get((dtype, fp8, num_heads // num_kv_heads, head_dim))
                or self._fns[(dtype, fp8, 0, 0)])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """q/out (n, H, D) contiguous; caches (blocks, bs, KVH, D) in q's dtype or FP8 (read
        as stored x k_scale / v_scale); block_tables (n, m) int64 with unit column stride;
        seq_lens (n,) int64. Writes `out`."""
        n, H, D = q.shape
        bs, KVH = k_cache.shape[1], k_cache.shape[2]
        fp8 = k_cache.dtype in FP8
        args: list[int | float] = [
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), n, H, KVH, D, bs]
        if fp8:
            table = self._tables[k_cache.dtype]
            args += [scale * k_scale, v_scale, table.data_ptr(),
                     int(k_cache.dtype == torch.float8_e4m3fn)]
        else:
            args.append(scale)
        rc = self.kernel(q.dtype, H, KVH, D, fp8)(*args)
        if rc != 0:
            raise RuntimeError(f"native paged decode attention failed (code {rc})")


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
        self._tables = {dt: fp8_table(dt) for dt in FP8}

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
        fp8 = k_cache.dtype in FP8
        table = self._tables[k_cache.dtype].data_ptr() if fp8 else None
        fn = self._fns.get((q.dtype, fp8, D)) or self._fns[(q.dtype, fp8, 0)]
        rc = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seqs.data_ptr(), out.data_ptr(),
            out.stride(0), seqs.shape[0], H, KVH, D, bs, scale * k_scale,
            int(self.use_bf16_dot), v_scale, table)
        if rc != 0:
            raise RuntimeError(f"native paged prefill attention failed (code {rc})")


def load_decode(cache_dir: Path) -> NativeDecodeAttention | None:
    """Build (once per source version) and load the decode kernels; None if they cannot be
    built."""
    lib = load_library("paged_decode.c", cache_dir)
    return None if lib is None else NativeDecodeAttention(lib)


def load_prefill(cache_dir: Path) -> NativePrefillAttention | None:
    """Build (once per source version) and load the prefill kernels; None if they cannot be
    built."""
    lib = load_library("paged_prefill.c", cache_dir)
    return None if lib is None else NativePrefillAttention(lib)
