"""The Llama layer's small ops fused into C kernels (`csrc/cpu_ops.c`): residual add +
RMSNorm, SiLU(gate) * up, and rotary embedding of q and k, in float32 and bfloat16.

Why: each torch op on a (T, h) tensor costs ~10-30 us of dispatch and OpenMP start-up, and a
layer made ~15 of them; at decode sizes that overhead, not arithmetic, was the cost. The
model's torch code stays the fallback (no compiler, other dtypes, GPUs); `reference.py` holds
the same rounding steps for the tests.

Numerics: the torch code's rounding steps, one by one. Bit for bit: the residual add, and
rotary (always in bfloat16; in float32 where torch's addcmul is a fused multiply-add, as in
its AVX2 / AVX-512 kernels). A few fp32 ulps apart: the RMSNorm sum of squares (its order)
and SiLU's exp (a polynomial); in bfloat16 that moves 1 in ~10^5 norm outputs by one ulp
(measured: 6 of 2.3M; SiLU * up: 0 of 6.1M).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton_cpu.build import load_library

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr (typeshed's only public name)

_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


class CpuOps:
    DTYPES = tuple(_NAMES)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = {dt: _fn(lib, f"add_rms_norm_{n}", [_P] * 5 + [_I, _I, ctypes.c_float])
                      for dt, n in _NAMES.items()}
        self._silu = {dt: _fn(lib, f"silu_mul_{n}", [_P, _P, _I, _I])
                      for dt, n in _NAMES.items()}
        self._rotary = {dt: _fn(lib, f"rotary_{n}", [_P, _I, _P, _P, _P, _I, _P, _P] + [_I] * 4)
                        for dt, n in _NAMES.items()}

    def kernels(self, dtype: torch.dtype) -> dict[str, CFuncPtr]:
        """The C functions for `dtype` by op name (norm, silu_mul, rotary), for native
        callers such as `decode_step`."""
        return {"norm": self._norm[dtype], "silu_mul": self._silu[dtype],
                "rotary": self._rotary[dtype]}

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual (T, h) or None, weight (h,) -> (normed, x + residual), as RMSNorm does.
        Without a residual, the second result is x itself."""
        fn = _kernel(self._norm, x, "add_rms_norm")
        x = x.contiguous()
        T, h = x.shape
        if weight.shape != (h,) or weight.dtype != x.dtype or not weight.is_contiguous():
            raise ValueError(f"RMSNorm weight {tuple(weight.shape)} {weight.dtype} does not fit "
                             f"x {tuple(x.shape)} {x.dtype}")
        out = torch.empty_like(x)
        if residual is None:
            res_ptr, res_out = None, x
        else:
            if residual.shape != x.shape or residual.dtype != x.dtype:
                raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not "
                                 f"fit x {tuple(x.shape)} {x.dtype}")
            residual = residual.contiguous()
            res_ptr, res_out = residual.data_ptr(), torch.empty_like(x)
        _check(fn(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(),
                  None if residual is None else res_out.data_ptr(), T, h, eps), "add_rms_norm", x)
        return out, res_out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2I) with the gate columns first -> SiLU(gate) * up (T, I)."""
        fn = _kernel(self._silu, gate_up, "silu_mul")
        gate_up = gate_up.contiguous()
        T, I2 = gate_up.shape
        if I2 % 2:
            raise ValueError(f"gate_up has an odd width {I2}")
        out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
        _check(fn(gate_up.data_ptr(), out.data_ptr(), T, I2 // 2), "silu_mul", gate_up)
        return out

    def rotary(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv (T, >= (H + KVH) D) rows (unit column stride), positions (T,) int64, cos and
        signed sin tables (P, D) in qkv's dtype -> rotated q (T, H, D), k (T, KVH, D),
        contiguous. Positions outside the tables raise."""
        fn = _kernel(self._rotary, qkv, "rotary")
        T, H, KVH, D = qkv.shape[0], num_heads, num_kv_heads, head_dim
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        if (positions.dtype != torch.int64 or positions.shape != (T,) or cos.shape[1:] != (D,)
                or cos.shape != signed_sin.shape or cos.dtype != qkv.dtype
                or signed_sin.dtype != qkv.dtype or qkv.shape[1] < (H + KVH) * D):
            raise ValueError(f"rotary: qkv {tuple(qkv.shape)} {qkv.dtype}, positions "
                             f"{tuple(positions.shape)} {positions.dtype}, tables "
                             f"{tuple(cos.shape)} {cos.dtype} do not fit H={H} KVH={KVH} D={D}")
        positions, cos, signed_sin = (t.contiguous() for t in (positions, cos, signed_sin))
        q = torch.empty(T, H, D, dtype=qkv.dtype)
        k = torch.empty(T, KVH, D, dtype=qkv.dtype)
        _check(fn(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(),
                  signed_sin.data_ptr(), cos.shape[0], q.data_ptr(), k.data_ptr(), T, H, KVH, D),
               "rotary", qkv)
        return q, k


def _fn(lib: ctypes.CDLL, name: str, argtypes: list) -> CFuncPtr:
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return fn


def _kernel(kernels: dict, x: torch.Tensor, op: str) -> CFuncPtr:
    fn = kernels.get(x.dtype)
    if fn is None or not x.is_cpu:
        raise ValueError(f"native {op} runs on CPU float32 / bfloat16 tensors, not {x.dtype} "
                         f"on {x.device}")
    return fn


def _check(rc: int, op: str, x: torch.Tensor) -> None:
    if rc != 0:
        raise RuntimeError(f"native {op} failed (code {rc}: -1 bad shape, -2 position out of "
                           f"the rotary tables) for {tuple(x.shape)} {x.dtype}")


def load(cache_dir: Path) -> CpuOps | None:
    """Build (once per source version) and load the kernels; None if they cannot be built."""
    lib = load_library("cpu_ops.c", cache_dir)
    return None if lib is None else CpuOps(lib)
