"""The CPU platform's view of the model: the modules whose forward a fused C kernel replaces
(swapped in at `prepare`, their weights shared, the torch modules being the kernels'
fallback), and the plain Llama layers the one-call decode step computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

from baton.engine.attention.base import AttentionBackend
from baton.engine.models.base import CausalLM
from baton.engine.models.fused_moe import fused_experts, route
from baton.engine.models.layers import RMSNorm
from baton.engine.models.llama import MLP, Attention, DecoderLayer
from baton.engine.models.moe import SparseMoE
from baton.engine.models.rope import RotaryEmbedding
from baton_cpu import decode_step
from baton_cpu.linear import PackedLinear
from baton_cpu.ops import CpuOps
from baton_cpu.quant_linear import QuantLinear

if TYPE_CHECKING:
    from baton.engine.lora.layer import LoRAStepState
    from baton.engine.runner.batch import FlatBatch
    from baton_cpu.lora import NativeLoRA


class NativeRMSNorm(RMSNorm):
    """RMSNorm (offset 0) with the residual add fused in, in one kernel; `norm` (no
    residual, any shape: q/k norms) stays torch's."""

    def __init__(self, norm: RMSNorm, ops: CpuOps) -> None:
        nn.Module.__init__(self)  # not RMSNorm's: the weight is `norm`'s own
        self.weight, self.eps, self.offset, self.ops = norm.weight, norm.eps, norm.offset, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class NativeMLP(nn.Module):
    """A SiLU-gated MLP with SiLU(gate) * up in one kernel; the same linears."""

    def __init__(self, mlp: MLP, ops: CpuOps) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.ops = mlp.gate_up_proj, mlp.down_proj, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))  # (T, h)


class NativeSparseMoE(SparseMoE):
    """SparseMoE with each expert's SiLU(gate) * up in one kernel; the same parameters."""

    def __init__(self, moe: SparseMoE, ops: CpuOps) -> None:
        nn.Module.__init__(self)  # not SparseMoE's: the parameters are `moe`'s own
        self.gate, self.gate_up, self.down = moe.gate, moe.gate_up, moe.down
        self.top_k, self.renormalize, self.ops = moe.top_k, moe.renormalize, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # (T, k), (T, k)
        return fused_experts(x, self.gate_up, self.down, weights, ids, self.ops.silu_mul)


def _native(module: nn.Module, ops: CpuOps) -> nn.Module | None:
    if type(module) is RMSNorm and module.offset == 0.0:
        return NativeRMSNorm(module, ops)
    if type(module) is MLP and module.act == "silu":
        return NativeMLP(module, ops)
    if type(module) is SparseMoE:
        return NativeSparseMoE(module, ops)
    return None


def use_native_ops(model: nn.Module, ops: CpuOps) -> None:
    """Swap, in place, every module a fused kernel computes for its native twin, and give
    every rotary table the native rotary."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            native = _native(child, ops)
            if native is not None:
                setattr(parent, name, native)
            elif isinstance(child, RotaryEmbedding):
                child.kernel = ops


class NativeLlamaDecode:
    """The CPU platform's fast decode path: steps of single-token decodes only (speculative
    verification rows are decodes too: `runner.batch`), few enough for the portable GEMV
    (any number with the packed GEMM), through `baton_cpu`'s one-call Llama step."""

    def __init__(self, step: decode_step.LlamaDecodeStep, embed: nn.Module) -> None:
        self.step, self.embed = step, embed
        self.max_rows = step.max_rows  # None: any batch
        self.lora_state: LoRAStepState | None = None  # the step's adapter rows, attached
        self.lora_adapted: list[set[int] | None] | None = None
        self._lora_on: list[bool] | None = None  # the linears adding deltas, as last set

    def attach_lora(self, kernel: NativeLoRA, linears: list[list[object]],
                    state: LoRAStepState, embed: nn.Module | None = None,
                    adapted: list[set[int] | None] | None = None) -> bool:
        """Apply LoRA deltas after the linears (`LoRAManager.attach_fast_path`), and embed
        tokens through `embed` (the embedding with its LoRA deltas) where given: each
        step's row slots are read from `state`. `adapted`: each linear's (flat) slots
        holding an adapter of it, so a step skips the linears its adapters leave alone.
        True: attached."""
        self.step.attach_lora(kernel.address, linears)
        self.lora_state, self.lora_adapted = state, adapted
        if embed is not None:
            self.embed = embed
        return True

    def _select_lora_linears(self) -> None:
        state, adapted = self.lora_state, self.lora_adapted
        if state is None or adapted is None or state.row_slots is None:
            return
        on = [slots is not None and bool(slots & state.slots) for slots in adapted]
        if on != self._lora_on:
            self.step.select_lora_linears(on)
            self._lora_on = on

    def can_run(self, batch: FlatBatch) -> bool:
        layout = batch.layout
        return (layout.num_decodes == layout.num_seqs == len(batch.input_ids)
                and (self.max_rows is None or layout.num_seqs <= self.max_rows))

    def run(self, batch: FlatBatch) -> torch.Tensor:
        layout = batch.layout
        seq_lens = torch.tensor(layout.seq_lens, dtype=torch.int64)  # (T,)
        row_slots = None if self.lora_state is None else self.lora_state.row_slots
        self._select_lora_linears()
        return self.step(self.embed(batch.input_ids), batch.positions, layout.slot_mapping,
                         layout.block_tables, seq_lens, row_slots)  # (T, h)


def _all_packed(linears: tuple[nn.Module, ...]
                ) -> TypeGuard[tuple[PackedLinear | QuantLinear, ...]]:
    """Linears the one-call step computes: packed bf16 or GGUF-quantized (its `load` takes
    only one kind for the whole model)."""
    return all(isinstance(m, PackedLinear | QuantLinear) for m in linears)


def _plain_llama_layers(model: CausalLM) -> list[decode_step.LlamaLayer] | None:
    """The layers as the one-call step takes them, or None where the model has anything
    else: tensor parallelism, a window, a soft-cap, q/k norms, other norms or MLPs, linears
    not packed (float32)."""
    D = model.cfg.head_dim
    if model.tp.size != 1:
        return None
    layers = []
    for ly in model.layers:
        if not (type(ly) is DecoderLayer and type(ly.attn) is Attention
                and ly.attn.spec.plain and ly.attn.spec.scale == D ** -0.5):
            return None
        norms, mlp = (ly.input_norm, ly.post_attn_norm), ly.mlp
        linears = (ly.attn.qkv_proj, ly.attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not (all(type(n) is NativeRMSNorm for n in norms) and isinstance(mlp, NativeMLP)
                and _all_packed(linears)):
            return None
        qkv, o_proj, gate_up, down = linears
        layers.append(decode_step.LlamaLayer(norms[0].weight, qkv, o_proj, norms[1].weight,
                                             gate_up, down))
    return layers


def load_llama_decode(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      backend: AttentionBackend, ops: CpuOps,
                      cache_dir: Path) -> NativeLlamaDecode | None:
    """The one-call decode step for this model and cache, or None where the torch path must
    run: not plain Llama layers, no native decode attention, or `decode_step.load`'s refusal."""
    layers, norm = _plain_llama_layers(model), model.norm
    attention = getattr(backend, "native", None)  # the torch backend's C decode kernel
    if layers is None or attention is None or type(norm) is not NativeRMSNorm:
        return None
    cfg = model.cfg
    shape = decode_step.LlamaShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                   cfg.head_dim, cfg.intermediate_size, norm.eps)
    step = decode_step.load(shape, layers, norm.weight, model.rotary.tables(torch.bfloat16),
                            kv_caches, ops, attention, cache_dir)
    return None if step is None else NativeLlamaDecode(step, model.embed_tokens)
