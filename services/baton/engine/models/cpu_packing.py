"""Linear layers for bfloat16 on CPU: oneDNN prepacked weights, and a streaming GEMV for
small batches.

A prepacked weight skips the per-call reorder that `F.linear` pays (measured: 45 us vs 87 us
for a 3072x576 bf16 linear at batch 1, identical results). At up to `NativeGemv.max_rows`
rows (8 with AVX512-BF16, else 2) a step is bound by reading the weights, and oneDNN reads them on one core: the native
GEMV (`csrc/gemv_bf16.c`) splits the output rows over every thread instead (measured on the
bundled model's 121 linears with weights out of cache: 5.6-7.8 ms against oneDNN's 9.2-10.7
ms per batch-1 step). It reads the weights in their row-major layout, which PackedLinear keeps
beside the packed copy when the GEMV is available: a second copy of every linear weight
(269 MB for the bundled model), the price of both fast paths.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import nn

from baton.engine.native import load_library

_GEMV_SOURCE = Path(__file__).parent / "csrc" / "gemv_bf16.c"


class NativeGemv:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.kernel = lib.gemv_bf16
        self.kernel.restype = ctypes.c_int
        self.kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        # Rows up to which the GEMV beats oneDNN on this CPU (measured): 8 with AVX512-BF16,
        # 2 on the portable path.
        lib.gemv_bf16_max_rows.restype = ctypes.c_int
        self.max_rows = int(lib.gemv_bf16_max_rows())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x (M, K) with M <= 8, weight (N, K) contiguous, bias (N,) -> (M, N)."""
        x = x.contiguous()
        M, K = x.shape
        N = weight.shape[0]
        y = torch.empty(M, N, dtype=x.dtype)
        rc = self.kernel(x.data_ptr(), weight.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr(), M, N, K)
        if rc != 0:
            raise RuntimeError(f"native bf16 GEMV failed (code {rc}) for x {tuple(x.shape)}, "
                               f"weight {tuple(weight.shape)}")
        return y


def load_gemv(cache_dir: Path) -> NativeGemv | None:
    lib = load_library(_GEMV_SOURCE, cache_dir)
    return None if lib is None else NativeGemv(lib)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 gemv: NativeGemv | None = None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.gemv = gemv
        self.weight = weight.detach().contiguous() if gemv is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= self.gemv.max_rows:
            return self.gemv(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module, gemv: NativeGemv | None = None) -> None:
    """Replace every nn.Linear under `model` by a PackedLinear (in place)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias, gemv))
        else:
            pack_linears(child, gemv)
