"""Linear layers over GGUF block-quantized weights (Q8_0, Q4_0, Q4_1) on CPU, in
`csrc/linear_q.c`: the weight keeps the file's quants and fp16 scales (repacked once so that
8 output rows lie side by side), each call quantizes its bf16 activations to int8 per
32-block and takes integer dot products (VNNI where the CPU has it, else AVX2, else scalar).
`quant_reference.py` is the torch reference of the formats.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from baton_cpu.build import load_library
from baton_cpu.quant_reference import QK, QuantType

_P, _I = ctypes.c_void_p, ctypes.c_int64
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}


class QWeight(ctypes.Structure):
    """`qweight` in linear_q.c: what the kernel takes as its weight pointer."""

    _fields_ = [("type", _I), ("n", _I), ("k", _I), ("data", _P)]


class NativeQuantLinear:
    """The kernels of linear_q.c: `repack` once per weight, `kernel` per call (the bf16
    linear signature of `linear_bf16.c`, its weight a QWeight pointer)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.qlinear_isa.restype = ctypes.c_int
        self.isa = ISA_NAMES[int(lib.qlinear_isa())]
        self._bytes = lib.qlinear_packed_bytes
        self._bytes.restype, self._bytes.argtypes = _I, [_I] * 3
        self._repack = lib.qlinear_repack
        self._repack.restype, self._repack.argtypes = ctypes.c_int, [_I, _P, _I, _I, _P]
        self.kernel = lib.qlinear_bf16
        self.kernel.restype, self.kernel.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3

    def repack(self, raw: torch.Tensor, qtype: QuantType, n: int, k: int) -> torch.Tensor:
        """raw uint8 (n, k / 32 * block bytes), GGUF's rows -> the kernel's packed bytes.
        Raises ValueError for a shape the format cannot hold or a scale too large."""
        size = int(self._bytes(int(qtype), n, k))
        if size < 0 or tuple(raw.shape) != (n, k // QK * qtype.block_bytes):
            raise ValueError(f"a {qtype.name} weight of {n} x {k} cannot be packed from raw "
                             f"bytes {tuple(raw.shape)} (k must be a multiple of {QK})")
        raw = raw.contiguous()
        packed = torch.empty(size, dtype=torch.uint8)
        rc = self._repack(int(qtype), raw.data_ptr(), n, k, packed.data_ptr())
        if rc != 0:
            raise ValueError(f"a {qtype.name} weight of {n} x {k} has a scale past fp16's "
                             f"range once its offset is folded in (code {rc})")
        return packed


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) for bf16 x of any leading shape, W kept block-quantized."""

    def __init__(self, raw: torch.Tensor, qtype: QuantType, in_features: int,
                 bias: torch.Tensor | None, native: NativeQuantLinear) -> None:
        super().__init__()
        self.out_features, self.in_features = raw.shape[0], in_features
        self.qtype, self.native = qtype, native
        self.packed = native.repack(raw, qtype, self.out_features, in_features)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        self.qweight = QWeight(int(qtype), self.out_features, in_features,
                               self.packed.data_ptr())

    @property
    def weight_address(self) -> int:
        """The QWeight the kernel takes (valid while this module lives)."""
        return ctypes.addressof(self.qweight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise TypeError(f"QuantLinear takes bfloat16 activations, not {x.dtype}")
        rows = x.reshape(-1, self.in_features).contiguous()  # (M, K)
        M = rows.shape[0]
        y = torch.empty(M, self.out_features, dtype=torch.bfloat16)
        if M:
            rc = self.native.kernel(rows.data_ptr(), self.weight_address,
                                    None if self.bias is None else self.bias.data_ptr(),
                                    y.data_ptr(), M, self.out_features, self.in_features)
            if rc != 0:
                raise RuntimeError(f"native {self.qtype.name} linear failed (code {rc}) for "
                                   f"x {tuple(x.shape)}, {self.out_features} outputs")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.qtype.name}, {self.native.isa}")


def load_quant_kernels(cache_dir: Path, source: str = "linear_q.c") -> NativeQuantLinear | None:
    """The kernels (or None where they cannot be built). `source` may name a variant that
    builds a narrower path: `linear_q_avx2.c`, `linear_q_scalar.c` (the tests run all)."""
    lib = load_library(source, cache_dir)
    return None if lib is None else NativeQuantLinear(lib)
