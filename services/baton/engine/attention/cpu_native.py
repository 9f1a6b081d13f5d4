"""A small C kernel for paged decode attention on CPU (built by `baton.engine.native`).

Why: on CPU, gathering every sequence's pages and calling SDPA spends most of a large decode
step copying K/V and padding (measured ~2.5 ms per layer at 64 sequences x 300 tokens); the
kernel reads the pages in place. When it cannot be built, `load()` returns None and the torch
backend keeps its gather + SDPA path. FP8 caches have kernels of their own (bytes read
through a table of the format's values, `kv_quant.fp8_table`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton.engine.attention.kv_quant import fp8_table, is_fp8
from baton.engine.native import load_library

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr (typeshed's only public name)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"


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
        self._tables = {dt: fp8_table(dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}

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
        fp8 = is_fp8(k_cache.dtype)
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


def load(cache_dir: Path) -> NativeDecodeAttention | None:
    """Build (once per source version) and load the kernel; None if it cannot be built."""
    lib = load_library(_SOURCE, cache_dir)
    return None if lib is None else NativeDecodeAttention(lib)
