"""Decode steps in one native call on CPU (`csrc/llama_decode.c`).

Why: driving a decode step's ~360 kernels from Python added ~1.5 ms of interpreter,
dispatcher and allocation overhead per step (15% of a batch-1 step of the bundled model, and
~10 ms of a 60-row one). The C driver calls the very kernels the Python path uses (the linear
kernel, the fused norm / SiLU / rotary ops, the paged decode attention), through function
pointers taken from their libraries, so its hidden states equal the Python path's bit for bit
(the tests compare them). It runs where every one of those kernels is in use: bfloat16 on
CPU, the torch attention backend with its native decode kernel, and a step whose rows are all
single-token decodes; with the packed GEMM (AVX512-BF16) at any row count, with the portable
GEMV up to its row limit. Elsewhere the model runner keeps the Python path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton.engine.models.cpu_packing import PackedLinear
from baton.engine.native import load_library

if TYPE_CHECKING:
    from _ctypes import CFuncPtr  # what ctypes calls _CFuncPtr (typeshed's only public name)

_SOURCE = Path(__file__).parent / "csrc" / "llama_decode.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64


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
                                     "silu", "rotary", "attn")])


def _address(fn: CFuncPtr) -> int | None:
    return ctypes.cast(fn, _P).value  # (None would be NULL, which a loaded function is not)


class NativeDecodeStep:
    def __init__(self, lib: ctypes.CDLL, model, kv_caches, attention) -> None:
        cfg, layers = model.cfg, model.layers
        self._step = lib.llama_decode_step
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.POINTER(LlamaStack), _P, _P, _P, _P, _I, _P, _I, _P]
        native = layers[0].attn.qkv_proj.native
        packed = layers[0].attn.qkv_proj.vnni is not None
        # The packed GEMM serves any batch; the portable GEMV only a few rows.
        self.max_rows = None if packed else native.gemv_max_rows
        linear = native.gemm_kernel if packed else native.gemv_kernel
        weight = (lambda m: m.vnni) if packed else (lambda m: m.weight)
        self._embed = model.embed_tokens
        cos, sin = model.rotary.tables(torch.bfloat16)
        # Everything the struct points at stays referenced here.
        self._keep = [cos, sin, kv_caches]

        def pointers(tensors) -> ctypes._Pointer[ctypes.c_void_p]:
            arr = (_P * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])
            self._keep.append(arr)
            return ctypes.cast(arr, ctypes.POINTER(_P))

        ops = model.native.kernels(torch.bfloat16)
        s = LlamaStack(
            layers=len(layers), hidden=cfg.hidden_size, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, inter=cfg.intermediate_size,
            block_size=kv_caches[0][0].shape[1], rope_positions=cos.shape[0],
            cache_slots=kv_caches[0][0].shape[0] * kv_caches[0][0].shape[1],
            eps=model.norm.eps, scale=cfg.head_dim ** -0.5,
            input_norm=pointers([ly.input_norm.weight for ly in layers]),
            qkv=pointers([weight(ly.attn.qkv_proj) for ly in layers]),
            qkv_bias=pointers([ly.attn.qkv_proj.bias for ly in layers]),
            o_proj=pointers([weight(ly.attn.o_proj) for ly in layers]),
            post_norm=pointers([ly.post_attn_norm.weight for ly in layers]),
            gate_up=pointers([weight(ly.mlp.gate_up_proj) for ly in layers]),
            down=pointers([weight(ly.mlp.down_proj) for ly in layers]),
            k_cache=pointers([k for k, _ in kv_caches]),
            v_cache=pointers([v for _, v in kv_caches]),
            final_norm=model.norm.weight.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
            linear=_address(linear), norm=_address(ops["norm"]),
            silu=_address(ops["silu_mul"]), rotary=_address(ops["rotary"]),
            attn=_address(attention.kernel(torch.bfloat16, cfg.num_heads, cfg.num_kv_heads,
                                           cfg.head_dim)))
        lib.llama_decode_row_elems.restype = _I
        lib.llama_decode_row_elems.argtypes = [ctypes.POINTER(LlamaStack)]
        self._row_elems = int(lib.llama_decode_row_elems(ctypes.byref(s)))
        self._stack = s
        self._workspace = torch.empty(0, dtype=torch.bfloat16)
        self.hidden_size = cfg.hidden_size

    def can_run(self, batch) -> bool:
        """Whether `batch` (a runner FlatBatch) is all single-token decodes, few enough."""
        layout = batch.layout
        return (layout.num_decodes == layout.num_seqs == len(batch.input_ids)
                and (self.max_rows is None or layout.num_seqs <= self.max_rows))

    def _reserve(self, rows: int) -> None:
        """Grow the workspace (never shrunk: a step's batch only grows to max_num_seqs)."""
        if rows > self._stack.workspace_rows:
            self._workspace = torch.empty(rows * self._row_elems, dtype=torch.bfloat16)
            self._stack.workspace, self._stack.workspace_rows = self._workspace.data_ptr(), rows

    def __call__(self, batch) -> torch.Tensor:
        """The final hidden states (T, h) of a batch that `can_run`, writing this step's K/V
        into the caches."""
        layout = batch.layout
        x = self._embed(batch.input_ids)  # (T, h)
        T = x.shape[0]
        positions = batch.positions.contiguous()
        slots = layout.slot_mapping.contiguous()
        tables = layout.block_tables.contiguous()
        seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int64)
        out = torch.empty(T, self.hidden_size, dtype=torch.bfloat16)
        self._reserve(T)
        rc = self._step(ctypes.byref(self._stack), x.data_ptr(), positions.data_ptr(),
                        slots.data_ptr(), tables.data_ptr(), tables.stride(0),
                        seq_lens.data_ptr(), T, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decode step failed (code {rc}) for {T} rows at "
                               f"positions {positions.tolist()}, slots {slots.tolist()}")
        return out


def load(model, kv_caches, backend, cache_dir: Path) -> NativeDecodeStep | None:
    """The native decode step for this model, caches and attention backend, or None where the
    Python path must run: not bfloat16 on CPU, a kernel missing, or the build failing."""
    if not getattr(model, "native_decode", False):
        return None  # checked first: other architectures' layers lack these linears
    attention = getattr(backend, "native", None)
    linears = [m for layer in model.layers
               for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
                         layer.mlp.down_proj)]
    if (attention is None or model.native is None or not kv_caches
            or kv_caches[0][0].dtype != torch.bfloat16 or not kv_caches[0][0].is_cpu
            or not all(isinstance(m, PackedLinear) and m.native is not None for m in linears)):
        return None
    # One linear kernel for all: every weight packed, or every weight row-major.
    if not (all(m.vnni is not None for m in linears)
            or all(m.weight is not None for m in linears)):
        return None
    lib = load_library(_SOURCE, cache_dir)
    if lib is None:
        return None
    return NativeDecodeStep(lib, model, kv_caches, attention)
