"""Linear layers over GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) on CPU, in
`csrc/linear_q.c` and `csrc/linear_qk.h`: the weight keeps the file's quants and scales
(repacked once so that 8 or 16 output rows lie side by side), each call quantizes its bf16
activations to int8 per 32-block and takes integer dot products (VNNI where the CPU has it,
else AVX2, else scalar). A fused linear may hold parts of different types (a Q4_K_M file's
q and k in Q4_K, v in Q6_K). From `dequant_rows` rows on (a prefill chunk), where the CPU
has AVX512-BF16, the weights are de-quantized to bf16 tile by tile and run through the bf16
GEMM's tile instead (`csrc/linear_q_dequant.h`): the de-quantized model's results, at the
int8 path's speed or better. `quant_reference.py` is the torch reference of the formats.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from baton_cpu.build import load_library
from baton_cpu.quant_reference import QuantType

_P, _I = ctypes.c_void_p, ctypes.c_int64
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}


class QWeight(ctypes.Structure):
    """`qweight` in linear_q.c: what the kernel takes as its weight pointer (`next`: the
    part holding the rows after these, or NULL)."""

    _fields_ = [("type", _I), ("n", _I), ("k", _I), ("data", _P), ("next", _P),
                ("dequant_rows", _I)]


class NativeQuantLinear:
    """The kernels of linear_q.c: `repack` once per weight, `kernel` per call (the bf16
    linear signature of `linear_bf16.c`, its weight a QWeight pointer)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.qlinear_isa.restype = ctypes.c_int
        self.isa = ISA_NAMES[int(lib.qlinear_isa())]
        lib.qlinear_dequant_rows.restype = ctypes.c_int
        # batches of this many rows or more run de-quantized through the bf16 tile (0: never)
        self.dequant_rows = int(lib.qlinear_dequant_rows())
        self._bytes = lib.qlinear_packed_bytes
        self._bytes.restype, self._bytes.argtypes = _I, [_I] * 3
        self._repack = lib.qlinear_repack
        self._repack.restype, self._repack.argtypes = ctypes.c_int, [_I, _P, _I, _I, _P]
        self.kernel = lib.qlinear_bf16
        self.kernel.restype, self.kernel.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3

    def repack(self, raw: torch.Tensor, qtype: QuantType, n: int, k: int) -> torch.Tensor:
        """raw uint8 (n, k / block elems * block bytes), GGUF's rows -> the kernel's packed
        bytes. Raises ValueError for a shape the format cannot hold or a scale too large."""
        size = int(self._bytes(int(qtype), n, k))
        if size < 0 or tuple(raw.shape) != (n, k // qtype.block_elems * qtype.block_bytes):
            raise ValueError(f"a {qtype.name} weight of {n} x {k} cannot be packed from raw "
                             f"bytes {tuple(raw.shape)} (k must be a multiple of "
                             f"{qtype.block_elems})")
        raw = raw.contiguous()
        packed = torch.empty(size, dtype=torch.uint8)
        rc = self._repack(int(qtype), raw.data_ptr(), n, k, packed.data_ptr())
        if rc != 0:
            raise ValueError(f"a {qtype.name} weight of {n} x {k} has a scale past fp16's "
                             f"range once its offset is folded in (code {rc})")
        return packed


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) for bf16 x of any leading shape, W kept block-quantized: `raw`
    in `qtype`, or (`QuantLinear.fused`) the rows of several parts, each in its own type."""

    def __init__(self, raw: torch.Tensor, qtype: QuantType, in_features: int,
                 bias: torch.Tensor | None, native: NativeQuantLinear) -> None:
        self._init_parts([(raw, qtype)], in_features, bias, native)

    @classmethod
    def fused(cls, parts: Sequence[tuple[torch.Tensor, QuantType]], in_features: int,
              bias: torch.Tensor | None, native: NativeQuantLinear) -> QuantLinear:
        """The linear whose rows are those of `parts` (raw, type) in order; consecutive
        parts of one type are packed as one."""
        merged: list[tuple[torch.Tensor, QuantType]] = []
        for raw, qtype in parts:
            if merged and merged[-1][1] == qtype:
                merged[-1] = (torch.cat([merged[-1][0], raw]), qtype)
            else:
                merged.append((raw, qtype))
        self = cls.__new__(cls)
        self._init_parts(merged, in_features, bias, native)
        return self

    def _init_parts(self, parts: list[tuple[torch.Tensor, QuantType]], in_features: int,
                    bias: torch.Tensor | None, native: NativeQuantLinear) -> None:
        super().__init__()
        if not parts:
            raise ValueError("a QuantLinear needs at least one part")
        self.in_features, self.native = in_features, native
        self.out_features = sum(raw.shape[0] for raw, _ in parts)
        self.qtypes = tuple(qtype for _, qtype in parts)
        self.qtype = self.qtypes[0]
        self.packed = [native.repack(raw, qtype, raw.shape[0], in_features)
                       for raw, qtype in parts]
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        # forward's weight (prefill chunks de-quantized from native.dequant_rows rows on) and
        # the one-call decode step's (decode rows: the int8 path at every batch, faster there)
        self._chain = self._link(parts, native.dequant_rows)
        self._step_chain = self._link(parts, 0)

    def _link(self, parts: list[tuple[torch.Tensor, QuantType]],
              dequant_rows: int) -> list[QWeight]:
        """The kernel's weight: one QWeight per part, the last the first part; each points at
        the next (valid while this module lives)."""
        chain: list[QWeight] = []
        for (raw, qtype), packed in reversed(list(zip(parts, self.packed, strict=True))):
            after = ctypes.addressof(chain[-1]) if chain else None
            chain.append(QWeight(int(qtype), raw.shape[0], self.in_features, packed.data_ptr(),
                                 after, dequant_rows))
        return chain

    def set_dequant_rows(self, rows: int) -> None:
        """From `rows` rows on, `forward` de-quantizes to bf16 (0: never, every batch through
        the int8 activations: one path for every batch, as deterministic mode needs)."""
        if rows and not self.native.dequant_rows:
            raise ValueError(f"this build of the quantized kernels ({self.native.isa}) has no "
                             "bf16 path (it needs AVX512-BF16)")
        for part in self._chain:
            part.dequant_rows = rows

    @property
    def weight_address(self) -> int:
        """The QWeight the kernel takes in `forward` (valid while this module lives)."""
        return ctypes.addressof(self._chain[-1])

    @property
    def step_weight_address(self) -> int:
        """The QWeight for the one-call decode step: the int8 path at any batch."""
        return ctypes.addressof(self._step_chain[-1])

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
                raise RuntimeError(f"native {self.type_names} linear failed (code {rc}) for "
                                   f"x {tuple(x.shape)}, {self.out_features} outputs")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.type_names}, {self.native.isa}")

    @property
    def type_names(self) -> str:
        """e.g. Q4_1, or Q4_K+Q6_K for a fused linear of parts."""
        return "+".join(t.name for t in self.qtypes)


def load_quant_kernels(cache_dir: Path, source: str = "linear_q.c") -> NativeQuantLinear | None:
    """The kernels (or None where they cannot be built). `source` may name a variant that
    builds a narrower path: `linear_q_avx2.c`, `linear_q_scalar.c` (the tests run all)."""
    lib = load_library(source, cache_dir)
    return None if lib is None else NativeQuantLinear(lib)
