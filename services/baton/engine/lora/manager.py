"""`LoRAManager`: the model runner's one handle on LoRA. At start it wraps every adaptable
linear of the prepared model in a `LoRALinear` and loads `--lora-modules`; before each
forward it makes the step's adapters resident and sets the rows -> slots mask, and says
whether the step has adapter rows. Such a step takes the layer-by-layer path, unless the
fast decode path applies the adapters too (`fast_path_ready`: the CPU's one-call step in
bf16, given the LoRA kernel by `attach_fast_path`); CUDA graphs compute the base only.

Call `begin_step` / `end_step` from the engine thread; `registry` from any thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from baton.engine.lora.adapter import LoRAAdapter, build_adapter
from baton.engine.lora.config import LoRAConfig
from baton.engine.lora.layer import DeltaKernel, LoRAEmbedding, LoRALinear, LoRAStepState
from baton.engine.lora.peft_files import read_peft_adapter
from baton.engine.lora.registry import AdapterRegistry
from baton.engine.lora.slots import LoRASlots
from baton.engine.lora.stats import LoRACounters
from baton.engine.lora.targets import EMBEDDING, HEAD, LoRATarget
from baton.engine.models.base import CausalLM
from baton_cpu.lora import NativeLoRA, load_lora_kernel

if TYPE_CHECKING:
    from baton.engine.runner.batch import FlatBatch

# A Llama layer's linears in the order the one-call step runs them (`llama_decode.c`)
FAST_PATH_LINEARS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRAManager:
    def __init__(self, model: CausalLM, targets: dict[str, LoRATarget], config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device, cache_dir: Path) -> None:
        """`targets`: `lora_targets` of the model as loaded; `model`: prepared (its
        linears as the platform runs them), wrapped here in place; `cache_dir`: where the
        CPU kernel is built."""
        self.config, self.dtype, self.device = config, dtype, device
        self.counters = LoRACounters()
        self.state = LoRAStepState()
        native = _delta_kernel(device, dtype, cache_dir)
        if HEAD in targets:
            model.own_head()
        self.layers = {name: _wrap(model, name, spec, config, dtype, device, self.state, native)
                       for name, spec in targets.items()}
        self.embedding = self.layers.get(EMBEDDING)
        self._step_slots: torch.Tensor | None = None  # the last step's row slots (T,), CPU
        for layer in self.layers.values():
            layer.warm_up()
        self.fast_path_ready = False
        self.slots = LoRASlots(self.layers, config.max_loras, self.counters)
        build = partial(_load_adapter, model=model, targets=targets, config=config,
                        dtype=dtype)
        self.registry = AdapterRegistry(build, config.host_capacity, self.counters)
        for name, path in config.modules:
            self.registry.add(name, path)

    def begin_step(self, batch: FlatBatch) -> bool:
        """Make the step's adapters resident and set the mask; False (mask None) when no
        row of `batch` uses an adapter."""
        loras = [req.lora for req in batch.seq_requests]
        distinct = list({a.load_id: a for a in loras if a is not None}.values())
        if not distinct:
            self.state.mask = self._step_slots = None
            self.state.slots = frozenset()
            return False
        slot_of = self.slots.activate(distinct)
        seq_slots = [-1 if a is None else slot_of[a.load_id] for a in loras]
        qsl = batch.layout.query_start_loc
        counts = [qsl[i + 1] - qsl[i] for i in range(len(seq_slots))]
        row_slots = torch.repeat_interleave(torch.tensor(seq_slots), torch.tensor(counts))  # (T,)
        self.state.mask, self.state.row_slots = self._on_device(row_slots)
        self.state.slots = frozenset(slot_of.values())  # kept past end_step for the head
        self._step_slots = row_slots
        return True

    def end_step(self) -> None:
        self.state.mask = self.state.row_slots = None

    def _on_device(self, row_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows -> slots mask (R, n, 1) of row_slots (R,) (n: the highest slot + 1) and
        row_slots itself, both on the device."""
        used = torch.arange(max(int(row_slots.max()), 0) + 1)  # (n,)
        mask = (row_slots.unsqueeze(1) == used).to(self.dtype).unsqueeze(-1)  # (R, n, 1)
        return (mask.to(self.device, non_blocking=True),
                row_slots.to(self.device, non_blocking=True))

    @contextmanager
    def logits_rows(self, rows: list[int] | slice) -> Iterator[None]:
        """While the head computes logits of the last step's hidden[rows] (row indices or a
        slice), its adapter rows are those rows' (none when that step had none)."""
        head = self.layers.get(HEAD)
        if self._step_slots is None or head is None or not head.adapted & self.state.slots:
            yield  # no adapter of the step adapts the head: its rows need no slots
            return
        row_slots = self._step_slots[torch.tensor(rows) if isinstance(rows, list) else rows]
        self.state.head_mask, self.state.head_row_slots = self._on_device(row_slots)
        self.state.head_slots = frozenset(row_slots.unique().tolist()) - {-1}
        try:
            yield
        finally:
            self.state.head_mask = self.state.head_row_slots = None
            self.state.head_slots = frozenset()

    def attach_fast_path(self, fast_decode: object, num_layers: int) -> None:
        """Give the platform's fast decode path the adapters' buffers and the step's row
        slots, when it can apply them (the CPU one-call step, every linear on the LoRA
        kernel); else steps with adapter rows keep off it."""
        attach = getattr(fast_decode, "attach_lora", None)
        names = [[f"layers.{i}.{leaf}" for leaf in FAST_PATH_LINEARS]
                 for i in range(num_layers)]
        descs = [[self.layers[n].desc if n in self.layers else None for n in layer]
                 for layer in names]
        linears = [ly for ly in self.layers.values() if isinstance(ly, LoRALinear)]
        kernel = next((ly.native for ly in linears), None)
        if attach is None or not isinstance(kernel, NativeLoRA) or any(
                n in self.layers and self.layers[n].desc is None for ly in names for n in ly):
            return
        adapted = [self.layers[n].adapted if n in self.layers else None
                   for ly in names for n in ly]
        self.fast_path_ready = bool(attach(kernel, descs, self.state, self.embedding, adapted))


def _wrap(model: CausalLM, name: str, spec: LoRATarget, config: LoRAConfig,
          dtype: torch.dtype, device: torch.device, state: LoRAStepState,
          native: DeltaKernel | None) -> LoRALinear | LoRAEmbedding:
    """Replace module `name` of `model` (a linear, the embedding) by its LoRA wrapper over
    it, with empty slots."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    slots, rank = config.max_loras, config.max_lora_rank
    parts = list(spec.parts.values())  # (first output row, rows) of each part, in order
    a = torch.zeros(slots, len(parts) * rank, spec.in_features, dtype=dtype, device=device)
    b = [torch.zeros(slots, rank, cols, dtype=dtype, device=device) for _, cols in parts]
    layer: LoRALinear | LoRAEmbedding = (
        LoRAEmbedding(getattr(parent, leaf), a, b, state) if name == EMBEDDING else
        LoRALinear(getattr(parent, leaf), a, b, parts, state, native, head=name == HEAD))
    setattr(parent, leaf, layer)
    return layer


def _delta_kernel(device: torch.device, dtype: torch.dtype,
                  cache_dir: Path) -> DeltaKernel | None:
    """The device's kernel for the deltas: the C kernel on CPU in bf16, the Triton kernels
    on CUDA; None (torch matmuls) elsewhere, or where it cannot be built or imported."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return load_lora_kernel(cache_dir)
    if device.type == "cuda":
        try:
            from baton_kernels.lora import TritonLoRA
        except ImportError:  # no triton: the torch path
            return None
        return TritonLoRA()
    return None


def _load_adapter(name: str, path: str, load_id: int, *, model: CausalLM,
                  targets: dict[str, LoRATarget], config: LoRAConfig,
                  dtype: torch.dtype) -> LoRAAdapter:
    peft = read_peft_adapter(name, path, config.max_lora_rank)
    return build_adapter(name, path, load_id, peft, model, targets, config.max_lora_rank, dtype)
