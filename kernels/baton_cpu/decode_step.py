"""A Llama decode step in one native call on CPU (`csrc/llama_decode.c`).

Why: driving a decode step's ~360 kernels from Python added ~1.5 ms of interpreter,
dispatcher and allocation overhead per step (15% of a batch-1 step of the bundled model, and
~10 ms of a 60-row one). The C driver calls the very kernels the Python path uses (the linear
kernel, the fused norm / SiLU / rotary ops, the paged decode attention), through function
pointers taken from their libraries, so its hidden states equal the Python path's bit for bit
(the engine's tests compare them). It computes plain Llama layers in bfloat16, one token per
sequence; the caller (the engine's CPU platform) decides which models and steps those are.
Its linears are either all PackedLinear or all QuantLinear (GGUF blocks, `quant_linear.py`:
the quantized kernel has the bf16 linear's signature, its weight a `qweight` pointer).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from baton_cpu.attention import NativeDecodeAttention
from baton_cpu.build import load_library
from baton_cpu.linear import PackedLinear
from baton_cpu.ops import CpuOps
from baton_cpu.quant_linear import QuantLinear

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr (typeshed's only public name)

_P, _I = ctypes.c_void_p, ctypes.c_int64
Cache = tuple[torch.Tensor, torch.Tensor]  # a layer's (k, v): (blocks, block_size, KVH, D)


class LlamaStack(ctypes.Structure):
    """`llama_stack` in llama_decode.c, field by field."""

    _fields_ = ([(n, _I) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                   "inter", "block_size", "rope_positions", "workspace_rows",
                                   "cache_slots")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(n, ctypes.POINTER(_P)) for n in (
                    "input_norm", "qkv", "qkv_bias", "o_proj", "post_norm", "gate_up", "down",
                    "k_cache", "v_cache")]
                + [(n, _P) for n in ("final_norm", "cos", "sin", "workspace", "linear", "norm",
                                     "silu", "rotary", "attn", "lora")]
                + [("lora_linears", ctypes.POINTER(_P)), ("row_slot", _P)])


Linear = PackedLinear | QuantLinear


@dataclass(frozen=True)
class LlamaLayer:
    """One layer's weights: bf16 norms (h,) and the four linears, packed for the kernels."""

    input_norm: torch.Tensor
    qkv: Linear  # q outputs, then k, then v
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate outputs, then up
    down: Linear


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float


def _address(fn: CFuncPtr) -> int | None:
    return ctypes.cast(fn, _P).value  # (None would be NULL, which a loaded function is not)


def _linear_kernel(first: Linear) -> tuple[CFuncPtr, Callable[[Linear], int], int | None]:
    """The linear kernel the step calls for linears like `first`, a linear's weight pointer
    for it, and the most rows it serves (None: any)."""
    if isinstance(first, QuantLinear):
        return first.native.kernel, lambda m: cast(QuantLinear, m).step_weight_address, None
    native = first.native
    assert native is not None  # `load` takes only natively packed linears
    packed = first.vnni is not None

    def weight_of(m: Linear) -> int:
        w = cast(PackedLinear, m).vnni if packed else cast(PackedLinear, m).weight
        assert w is not None  # `load` takes linears packed one way only
        return w.data_ptr()

    # The packed GEMM serves any batch; the portable GEMV only a few rows.
    if packed:
        return native.gemm_kernel, weight_of, None
    return native.gemv_kernel, weight_of, native.gemv_max_rows


class LlamaDecodeStep:
    """`step(x, positions, slots, block_tables, seq_lens) -> out`: the final-normed hidden
    states (M, h) of M single-token rows, their K/V written into the caches."""

    def __init__(self, lib: ctypes.CDLL, shape: LlamaShape, layers: list[LlamaLayer],
                 final_norm: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 caches: list[Cache], ops: CpuOps, attention: NativeDecodeAttention) -> None:
        self._step = lib.llama_decode_step
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.POINTER(LlamaStack), _P, _P, _P, _P, _I, _P, _I, _P]
        linear, weight_of, self.max_rows = _linear_kernel(layers[0].qkv)
        cos, sin = rope
        # Everything the struct points at stays referenced here.
        self._keep: list[object] = [cos, sin, caches, layers, final_norm]

        def pointers(tensors) -> ctypes._Pointer[ctypes.c_void_p]:
            arr = (_P * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
            self._keep.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(_P))

        def weights(pick) -> ctypes._Pointer[ctypes.c_void_p]:
            arr = (_P * len(layers))(*[weight_of(pick(ly)) for ly in layers])
            self._keep.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(_P))

        kernels = ops.kernels(torch.bfloat16)
        k_cache = caches[0][0]
        s = LlamaStack(
            layers=len(layers), hidden=shape.hidden, heads=shape.heads,
            kv_heads=shape.kv_heads, head_dim=shape.head_dim, inter=shape.inter,
            block_size=k_cache.shape[1], rope_positions=cos.shape[0],
            cache_slots=k_cache.shape[0] * k_cache.shape[1],
            eps=shape.eps, scale=shape.head_dim ** -0.5,
            input_norm=pointers([ly.input_norm for ly in layers]),
            qkv=weights(lambda ly: ly.qkv), qkv_bias=pointers([ly.qkv.bias for ly in layers]),
            o_proj=weights(lambda ly: ly.o_proj),
            post_norm=pointers([ly.post_norm for ly in layers]),
            gate_up=weights(lambda ly: ly.gate_up), down=weights(lambda ly: ly.down),
            k_cache=pointers([k for k, _ in caches]), v_cache=pointers([v for _, v in caches]),
            final_norm=final_norm.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
            linear=_address(linear), norm=_address(kernels["norm"]),
            silu=_address(kernels["silu_mul"]), rotary=_address(kernels["rotary"]),
            attn=_address(attention.kernel(torch.bfloat16, shape.heads, shape.kv_heads,
                                           shape.head_dim)))
        lib.llama_decode_row_elems.restype = _I
        lib.llama_decode_row_elems.argtypes = [ctypes.POINTER(LlamaStack)]
        self._row_elems = int(lib.llama_decode_row_elems(ctypes.byref(s)))
        self._stack = s
        self._workspace = torch.empty(0, dtype=torch.bfloat16)
        self.hidden_size = shape.hidden

    def _reserve(self, rows: int) -> None:
        """Grow the workspace (never shrunk: a step's batch only grows to max_num_seqs)."""
        if rows > self._stack.workspace_rows:
            self._workspace = torch.empty(rows * self._row_elems, dtype=torch.bfloat16)
            self._stack.workspace, self._stack.workspace_rows = self._workspace.data_ptr(), rows

    def attach_lora(self, kernel_address: int | None, linears: list[list[object]]) -> None:
        """Add LoRA deltas after the linears: `linears[l]` holds layer l's (qkv, o, gate_up,
        down) `lora.LoRALinearDesc` or None, kept alive here; `kernel_address` is
        `lora.NativeLoRA.address`. Each call's `row_slots` then says which rows use which."""
        flat = [d for layer in linears for d in layer]
        self._lora_addresses = [None if d is None else ctypes.addressof(d)  # type: ignore[arg-type]  # ctypes.Structure
                                for d in flat]
        self._lora_linears = (_P * len(flat))(*self._lora_addresses)
        self._keep += [flat, self._lora_linears]
        self._stack.lora_linears = ctypes.cast(self._lora_linears, ctypes.POINTER(_P))
        self._stack.lora = kernel_address

    def select_lora_linears(self, on: list[bool]) -> None:
        """From the next call, only the attached linears `on` (flat: layer by layer, qkv, o,
        gate_up, down) add deltas: the step's adapters adapt none of the others."""
        for i, (address, use) in enumerate(zip(self._lora_addresses, on, strict=True)):
            self._lora_linears[i] = address if use else None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 row_slots: torch.Tensor | None = None) -> torch.Tensor:
        """x (M, h) embedded tokens; positions, slots (-1: not written), seq_lens (M,) int64;
        block_tables (M, m) int64; row_slots (M,) int64: each row's LoRA slot (-1: none; None:
        no adapter rows) -> (M, h). Raises RuntimeError (nothing written) for a position past
        the rotary tables or a slot past the caches."""
        M = x.shape[0]
        self._stack.row_slot = None if row_slots is None else row_slots.data_ptr()
        positions, slots = positions.contiguous(), slots.contiguous()
        block_tables = block_tables.contiguous()
        out = torch.empty(M, self.hidden_size, dtype=torch.bfloat16)
        self._reserve(M)
        rc = self._step(ctypes.byref(self._stack), x.data_ptr(), positions.data_ptr(),
                        slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                        seq_lens.data_ptr(), M, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decode step failed (code {rc}) for {M} rows at "
                               f"positions {positions.tolist()}, slots {slots.tolist()}")
        return out


def load(shape: LlamaShape, layers: list[LlamaLayer], final_norm: torch.Tensor,
         rope: tuple[torch.Tensor, torch.Tensor], caches: list[Cache], ops: CpuOps,
         attention: NativeDecodeAttention, cache_dir: Path) -> LlamaDecodeStep | None:
    """The step over these bf16 weights and caches, or None where it cannot run: a linear
    not packed by the native kernels, linears packed two ways (the step has one linear
    kernel), caches not bf16 on CPU, or the driver failing to build."""
    linears = [m for ly in layers for m in (ly.qkv, ly.o_proj, ly.gate_up, ly.down)]
    if not caches or caches[0][0].dtype != torch.bfloat16 or not caches[0][0].is_cpu:
        return None
    quant = [m for m in linears if isinstance(m, QuantLinear)]
    packed = [m for m in linears if isinstance(m, PackedLinear)]
    if quant and (packed or len({m.native for m in quant}) != 1):
        return None
    if packed and (not all(m.native is not None for m in packed)
                   or not (all(m.vnni is not None for m in packed)
                           or all(m.weight is not None for m in packed))):
        return None
    lib = load_library("llama_decode.c", cache_dir)
    if lib is None:
        return None
    return LlamaDecodeStep(lib, shape, layers, final_norm, rope, caches, ops, attention)
