"""LoRA deltas on bf16 rows, each row its own adapter (`csrc/lora_bf16.c`): what the engine's
`LoRALinear` computes on CPU in bf16 and what the one-call decode step calls after each
linear, so both paths add the same bits. Imports nothing from `baton`."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from baton_cpu.build import load_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
MAX_PARTS, MAX_RANK = 4, 512


class LoRALinearDesc(ctypes.Structure):
    """`lora_linear` in lora_bf16.c: one linear's resident adapters."""

    _fields_ = [("a", _P), ("b", _P * MAX_PARTS), ("first", _I * MAX_PARTS),
                ("cols", _I * MAX_PARTS), ("parts", _I), ("rank", _I), ("in_features", _I),
                ("out_features", _I)]


class NativeLoRA:
    """The loaded kernel: `describe` a linear's buffers once, `add` per forward."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.kernel = lib.lora_add_bf16
        self.kernel.restype = ctypes.c_int
        self.kernel.argtypes = [ctypes.POINTER(LoRALinearDesc), _P, _P, _P, _I]

    @property
    def address(self) -> int | None:
        return ctypes.cast(self.kernel, _P).value

    @staticmethod
    def describe(a: torch.Tensor, b: list[torch.Tensor], parts: list[tuple[int, int]],
                 out_features: int) -> LoRALinearDesc:
        """A (slots, P R, in) and each part's B (slots, R, cols) — bf16, contiguous, kept
        alive by the caller — at output columns `parts` = [(first, cols)]. ValueError for
        buffers the kernel does not take."""
        rank = b[0].shape[1]
        if not (a.dtype == torch.bfloat16 and a.is_contiguous() and len(b) == len(parts)
                and 1 <= len(parts) <= MAX_PARTS and 1 <= rank <= MAX_RANK
                and all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in b)):
            raise ValueError("LoRA buffers must be contiguous bf16, at most "
                             f"{MAX_PARTS} parts of rank <= {MAX_RANK}")
        desc = LoRALinearDesc(a=a.data_ptr(), parts=len(parts), rank=rank,
                              in_features=a.shape[2], out_features=out_features)
        for p, ((first, cols), t) in enumerate(zip(parts, b)):
            desc.b[p], desc.first[p], desc.cols[p] = t.data_ptr(), first, cols
        return desc

    def add(self, desc: LoRALinearDesc, x: torch.Tensor, row_slots: torch.Tensor,
            y: torch.Tensor) -> None:
        """y (M, out) += each row's adapter's delta of x (M, in), in place; row_slots (M,)
        int64 (-1: none). All contiguous, on the CPU."""
        rc = self.kernel(ctypes.byref(desc), x.data_ptr(), row_slots.data_ptr(), y.data_ptr(),
                         x.shape[0])
        if rc != 0:
            raise RuntimeError(f"the LoRA kernel failed (code {rc}) on {x.shape[0]} rows")


def load_lora_kernel(cache_dir: Path) -> NativeLoRA | None:
    """The kernel, or None where it cannot be built (the torch path runs)."""
    lib = load_library("lora_bf16.c", cache_dir, extra_flags=("-ffp-contract=fast",))
    return None if lib is None else NativeLoRA(lib)
