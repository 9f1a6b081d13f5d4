"""Linear layers on CPU: for bfloat16 our own GEMM over weights packed once, or oneDNN's;
for float32 a GEMV for the few rows of a small decode batch (`csrc/linear_f32.c`).

Where the CPU has AVX512-BF16, every linear runs the native GEMM of `csrc/linear_bf16.c`
over its weight packed into pairs of k (the same bytes as the weight; the row-major and
oneDNN copies are dropped): it beat oneDNN's prepacked bf16 GEMM at every batch measured
(1 to 2,048 rows of the bundled model's layers, 8-36% less time) and the row-major GEMV it
replaced at 1-8 rows. Elsewhere oneDNN's prepacked weight serves (a prepacked weight skips
the per-call reorder that `F.linear` pays: 45 us vs 87 us for a 3072x576 bf16 linear at batch
1), with a native GEMV over a row-major copy for 1-2 rows, where a step is bound by reading
the weights and oneDNN reads them on one core. On a CPU where oneDNN cannot run bf16 at
all (no AVX512BW/VL/DQ nor AVX-NE-CONVERT: its prepack raises), the row-major weight serves
through the native GEMV for small batches and `F.linear` for the rest (slow there: 61 ms
for 512 x 576 -> 1536 on AVX2. An fp32 GEMM over per-call upcasts takes 7 ms but page-faults
its buffers in every prefill step, which the malloc tuning exists to stop; not taken).

In float32 the weight stays torch's own (no copy): up to `gemv_f32_max_rows` rows go through
the native GEMV, which reads each weight row once for all of them (torch's sgemm reads them
per row on AVX2: a batch-2 decode step cost 1.8x a batch-1 step), more rows through
`F.linear`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from baton_cpu.build import load_library

_P, _I = ctypes.c_void_p, ctypes.c_int64


class NativeLinear:
    """The kernels of linear_bf16.c: `gemm` (packed weights, when `has_vnni`) and `gemv`
    (row-major weights, up to `gemv_max_rows` rows). Both write y (M, N) from x (M, K)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.linear_bf16_has_vnni.restype = ctypes.c_int
        lib.gemv_bf16_max_rows.restype = ctypes.c_int
        self.has_vnni = bool(lib.linear_bf16_has_vnni())
        self.gemv_max_rows = int(lib.gemv_bf16_max_rows())
        self.gemm_kernel, self.gemv_kernel = lib.gemm_vnni_bf16, lib.gemv_bf16
        for fn in (self.gemm_kernel, self.gemv_kernel):
            fn.restype, fn.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3
        self._pack = lib.pack_vnni_bf16
        self._pack.restype, self._pack.argtypes = ctypes.c_int, [_P, _P, _I, _I]

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight (N, K) bf16 -> its VNNI packing for `gemm`, or None where the GEMM cannot
        serve it (no AVX512-BF16, N not a multiple of 16, K odd)."""
        N, K = weight.shape
        if not self.has_vnni or weight.dtype != torch.bfloat16 or N % 16 or K % 2:
            return None
        weight = weight.detach().contiguous()
        packed = torch.empty(N * K, dtype=torch.bfloat16)
        if self._pack(weight.data_ptr(), packed.data_ptr(), N, K) != 0:
            return None
        return packed

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
             n: int) -> torch.Tensor:
        """x (M, K) bf16, `packed` from pack() of an (n, K) weight -> (M, n)."""
        return self._run(self.gemm_kernel, x, packed, bias, n, "GEMM")

    def gemv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """x (M, K) with M <= gemv_max_rows, weight (N, K) contiguous -> (M, N)."""
        return self._run(self.gemv_kernel, x, weight, bias, weight.shape[0], "GEMV")

    @staticmethod
    def _run(fn, x, w, bias, n: int, what: str) -> torch.Tensor:
        x = x.contiguous()
        M, K = x.shape
        y = torch.empty(M, n, dtype=x.dtype)
        if M == 0:
            return y
        rc = fn(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
                y.data_ptr(), M, n, K)
        if rc != 0:
            raise RuntimeError(f"native bf16 {what} failed (code {rc}) for x {tuple(x.shape)}, "
                               f"{n} outputs")
        return y


def load_linear_kernels(cache_dir: Path) -> NativeLinear | None:
    lib = load_library("linear_bf16.c", cache_dir)
    return None if lib is None else NativeLinear(lib)


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bf16 on this CPU (its weight prepack raises where it cannot)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """One of three forms, chosen once: `vnni` (the native GEMM for every batch), oneDNN's
    `packed` weight plus, with native kernels, a row-major `weight` for the GEMV; or, where
    oneDNN has no bf16, only the row-major `weight` (GEMV for few rows, else `F.linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 native: NativeLinear | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        self.native = native
        self.vnni = None if native is None else native.pack(weight)
        self.packed = self.weight = None
        if self.vnni is None:
            if onednn_bf16_supported():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            if native is not None or self.packed is None:
                self.weight = weight.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None:
            assert self.native is not None  # vnni is its packing
            if x.dim() == 2:
                return self.native.gemm(x, self.vnni, self.bias, self.out_features)
            y = self.native.gemm(x.reshape(-1, self.in_features), self.vnni, self.bias,
                                 self.out_features)  # a batch of another rank: flattened
            return y.view(*x.shape[:-1], self.out_features)
        if (self.native is not None and x.dim() == 2
                and x.shape[0] <= self.native.gemv_max_rows):
            assert self.weight is not None  # kept (row-major) for the native GEMV
            return self.native.gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [],
                                                      "")
        assert self.weight is not None  # kept where there is no packed form
        return nn.functional.linear(x, self.weight, self.bias)


class NativeGemvF32:
    """`gemv_f32` of linear_f32.c: y (M, N) from x (M, K) and a row-major (N, K) weight, for
    1 <= M <= max_rows (0 where it was built without AVX2 + FMA)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.gemv_f32_max_rows.restype = ctypes.c_int
        self.max_rows = int(lib.gemv_f32_max_rows())
        self._kernel = lib.gemv_f32
        self._kernel.restype, self._kernel.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        return NativeLinear._run(self._kernel, x, weight, bias, weight.shape[0], "fp32 GEMV")


def load_gemv_f32(cache_dir: Path) -> NativeGemvF32 | None:
    """The fp32 GEMV, or None where it cannot be built or this CPU has no AVX2 + FMA."""
    lib = load_library("linear_f32.c", cache_dir)
    if lib is None:
        return None
    gemv = NativeGemvF32(lib)
    return gemv if gemv.max_rows > 0 else None


class SmallBatchLinear(nn.Module):
    """A float32 linear over torch's own weight: the native GEMV for a few rows (a decode
    step of a small batch), `F.linear` for more."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 gemv: NativeGemvF32) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= self.gemv.max_rows:
            return self.gemv(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module, native: NativeLinear | None = None,
                 gemv_f32: NativeGemvF32 | None = None) -> None:
    """Replace every nn.Linear under `model` (in place): a bf16 one by a PackedLinear, a
    float32 one by a SmallBatchLinear when the fp32 GEMV could be built."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            if child.weight.dtype == torch.bfloat16:
                setattr(model, name, PackedLinear(child.weight, child.bias, native))
            elif child.weight.dtype == torch.float32 and gemv_f32 is not None:
                setattr(model, name, SmallBatchLinear(child.weight, child.bias, gemv_f32))
        else:
            pack_linears(child, native, gemv_f32)


class InvariantGemm:
    """`gemm_invariant_bf16` / `_f32` of linear_invariant.c: y (M, N) from x (M, K) and a
    row-major (N, K) weight of the same dtype, each element's sums in one fixed order
    whatever M is (the deterministic mode's linear)."""

    DTYPES = (torch.bfloat16, torch.float32)

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.linear_invariant_vectorised.restype = ctypes.c_int
        self.vectorised = bool(lib.linear_invariant_vectorised())  # AVX2 + FMA
        self._kernels = {torch.bfloat16: lib.gemm_invariant_bf16,
                         torch.float32: lib.gemm_invariant_f32}
        for fn in self._kernels.values():
            fn.restype, fn.argtypes = ctypes.c_int, [_P] * 4 + [_I] * 3

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        return NativeLinear._run(self._kernels[weight.dtype], x, weight, bias,
                                 weight.shape[0], "batch-invariant GEMM")


def load_invariant_gemm(cache_dir: Path) -> InvariantGemm | None:
    """The batch-invariant GEMM, or None where it cannot be built. Built without
    re-association (its point is one fixed order of every sum)."""
    lib = load_library("linear_invariant.c", cache_dir, ("-fno-associative-math",))
    return None if lib is None else InvariantGemm(lib)


class InvariantLinear(nn.Module):
    """A linear whose every output row is the same bits whatever the batch around it
    (`InvariantGemm`): the deterministic mode's replacement for every nn.Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 gemm: InvariantGemm) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x.reshape(-1, self.in_features), self.weight, self.bias)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features)


def use_invariant_linears(model: nn.Module, gemm: InvariantGemm,
                          native: NativeLinear | None = None) -> None:
    """Replace every nn.Linear under `model` (in place) by a batch-invariant one: in bf16 on
    a CPU with AVX512-BF16 the packed VNNI GEMM (`native`) where it takes the shape — each
    row's sums run the whole K in its own accumulators, in one order for any M (tested) —
    else an InvariantLinear. Raises ValueError for a dtype neither has a kernel for."""
    for name, child in list(model.named_children()):
        if not isinstance(child, nn.Linear):
            use_invariant_linears(child, gemm, native)
            continue
        weight, bias = child.weight, child.bias
        if weight.dtype not in InvariantGemm.DTYPES:
            raise ValueError(f"deterministic mode has no batch-invariant linear for "
                             f"{weight.dtype} (layer {name!r}): use bfloat16 or float32")
        packed = None
        if native is not None and native.has_vnni and weight.dtype == torch.bfloat16:
            packed = PackedLinear(weight, bias, native)
        setattr(model, name, packed if packed is not None and packed.vnni is not None
                else InvariantLinear(weight, bias, gemm))
