"""CPU: the model's linears packed for our C GEMM / GEMV or oneDNN, its norms, SiLU * up and
rotary swapped for fused C kernels, and decode steps of plain Llama layers in bfloat16 run as
one C call — every kernel from `baton_cpu`, built on first use into `<cache_dir>/kernels`.
Where a kernel cannot be built the model keeps its torch code. glibc malloc is tuned for the
step's allocations once, when the platform is made (`host_malloc.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton.engine.models.moe import SparseMoE
from baton.engine.platforms.base import Platform
from baton.engine.platforms.cpu_layers import load_llama_decode, use_native_ops
from baton.engine.platforms.host_malloc import release_free_heap, tune_malloc_for_cpu_inference
from baton_cpu import linear, ops
from baton_cpu.quant_linear import QuantLinear

if TYPE_CHECKING:
    from baton.engine.models.base import CausalLM
    from baton.engine.runner.model_runner import ModelRunner


class CpuPlatform(Platform):
    """`deterministic`: every kernel batch-invariant (a row's result never depends on the
    rows beside it): linears through `baton_cpu.linear.use_invariant_linears`, no one-call
    decode step; the attention backend does its part (`TorchAttentionBackend.per_token`)."""

    name = "cpu"

    def __init__(self, cache_dir: Path, deterministic: bool = False) -> None:
        self.cache_dir = cache_dir
        self.deterministic = deterministic
        self.ops: ops.CpuOps | None = None  # the fused ops, once `prepare` built them
        tune_malloc_for_cpu_inference()

    def prepare(self, model: CausalLM) -> None:
        dtype = model.embed_tokens.weight.dtype
        if self.deterministic:
            self._invariant_linears(model)
        elif linear.can_pack(dtype, torch.device("cpu")):
            self._pack_linears(model)
        if dtype in ops.CpuOps.DTYPES:
            self.ops = ops.load(self.cache_dir)
            if self.ops is not None:
                use_native_ops(model, self.ops)

    def _invariant_linears(self, model: CausalLM) -> None:
        """Deterministic mode's linears; ValueError (naming why) for a model or machine it
        cannot serve: no C compiler, mixture-of-experts layers (grouped by expert, a token's
        rows depend on the batch), attention with windows or soft-caps (no per-token
        kernel)."""
        if any(isinstance(m, SparseMoE) for m in model.modules()):
            raise ValueError("deterministic mode does not serve mixture-of-experts models "
                             "(no batch-invariant expert kernels)")
        if not all(spec.plain for spec in model.attention_specs()):
            raise ValueError("deterministic mode serves plain causal attention only (this "
                             "model has sliding windows or soft-capped layers)")
        gemm = linear.load_invariant_gemm(self.cache_dir)
        if gemm is None:
            raise ValueError("deterministic mode needs baton_cpu's C kernels, which could not "
                             "be built here (is a C compiler installed?)")
        model.own_head()
        linear.use_invariant_linears(model, gemm, linear.load_linear_kernels(self.cache_dir))
        for module in model.modules():  # GGUF blocks (--quantization auto): one path for
            if isinstance(module, QuantLinear):  # every batch, the int8 activations
                module.set_dequant_rows(0)

    def _pack_linears(self, model: CausalLM) -> None:
        """Every linear packed (`baton_cpu.linear`: in bf16 the native GEMM, else oneDNN's;
        in fp32 the small-batch GEMV, when it can be built here); a tied head gets its own
        linear over the embedding."""
        native, gemv = None, None
        if model.embed_tokens.weight.dtype == torch.float32:
            gemv = linear.load_gemv_f32(self.cache_dir)
            if gemv is None:
                return  # F.linear it is
        else:
            native = linear.load_linear_kernels(self.cache_dir)
        model.own_head()
        linear.pack_linears(model, native, gemv)

    def warm_up(self, runner: ModelRunner) -> None:
        if self.ops is not None and runner.dtype == torch.bfloat16 and not self.deterministic:
            self.fast_decode = load_llama_decode(runner.model, runner.kv_caches,
                                                 runner.backend, self.ops, self.cache_dir)
        release_free_heap()  # the checkpoint's tensors, freed by packing


