"""A small C kernel for paged decode attention on CPU (built by `baton.engine.native`).

Why: on CPU, gathering every sequence's pages and calling SDPA spends most of a large decode
step copying K/V and padding (measured ~2.5 ms per layer at 64 sequences x 300 tokens); the
kernel reads the pages in place. When it cannot be built, `load()` returns None and the torch
backend keeps its gather + SDPA path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from baton.engine.native import load_library

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"


class NativeDecodeAttention:
    # (query heads per kv head, head dim) with compile-time specialised kernels.
    SPECIALISED = ((1, 64), (2, 64), (3, 64), (4, 64), (1, 128), (2, 128), (4, 128), (5, 128),
                   (7, 128), (8, 128))

    def __init__(self, lib: ctypes.CDLL) -> None:
        names = {torch.float32: "f32", torch.bfloat16: "bf16"}
        # (dtype, G, D) -> kernel; (dtype, 0, 0) is the generic one.
        self._fns = {(dt, 0, 0): getattr(lib, f"paged_decode_{name}")
                     for dt, name in names.items()}
        self._fns.update({(dt, g, d): getattr(lib, f"paged_decode_{name}_g{g}_d{d}")
                          for dt, name in names.items() for g, d in self.SPECIALISED})
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
            fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p,
                                                    ctypes.c_void_p] + [ctypes.c_int64] * 5
                           + [ctypes.c_float])

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
        return ((dtype, 0, 0) in self._fns and head_dim <= 256
                and num_heads // num_kv_heads <= 16)

    def kernel(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               head_dim: int) -> ctypes._CFuncPtr:
        """The C function for these shapes: a specialised one, else the generic one."""
        return (self._fns.get((dtype, num_heads // num_kv_heads, head_dim))
                or self._fns[(dtype, 0, 0)])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
        """q/out (n, H, D) contiguous; caches (blocks, bs, KVH, D); block_tables (n, m)
        int64 with unit column stride; seq_lens (n,) int64. Writes `out`."""
        n, H, D = q.shape
        bs, KVH = k_cache.shape[1], k_cache.shape[2]
        rc = self.kernel(q.dtype, H, KVH, D)(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), n, H, KVH, D, bs,
            scale)
        if rc != 0:
            raise RuntimeError(f"native paged decode attention failed (code {rc})")


def load(cache_dir: Path) -> NativeDecodeAttention | None:
    """Build (once per source version) and load the kernel; None if it cannot be built."""
    lib = load_library(_SOURCE, cache_dir)
    return None if lib is None else NativeDecodeAttention(lib)
