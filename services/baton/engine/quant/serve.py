"""`--quantization auto` for quantized safetensors checkpoints: each of our linears whose
checkpoint rows are all served natively is swapped for a quantized one, on the meta-device
model before its weights load (their float weights are never made; the loader skips what
they hold) or, with LoRA on, after the load (`--quantization none`: all de-quantized).

On CPU (bfloat16, the native kernels built): int4 / int8 weights in
runs of 32-input blocks become GGUF blocks (`gguf_blocks.py`) served by
`baton_cpu.quant_linear.QuantLinear`, exactly as a GGUF file's are. FP8 weights, act-order
GPTQ and asymmetric int8 stay de-quantized to bfloat16 (no native CPU kernel; logged).
On CUDA: every int and fp8 linear becomes a `GPUQuantLinear` (`gpu_linear.py`, Triton /
`_scaled_mm`). Under tensor parallelism each rank keeps its share: a column-parallel linear
its rows (scales and zeros with them), a row-parallel one its columns with their groups
(`_rank_columns`; a share that would split a group or FP8 block stays de-quantized).

Which checkpoint rows make which of our rows is asked of the model itself: its
`checkpoint_weights` maps each quantized linear's `weight` — given row indices in place of
the weight — and each fused parameter's `weight_loader` places them, so q / k / v and gate /
up fuse here as they do at load.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from baton.engine.distributed import TPGroup
from baton.engine.models.base import CausalLM
from baton.engine.models.loader import checkpoint_files
from baton.engine.quant.checkpoint import QuantCheckpoint, read_checkpoint_spec
from baton.engine.quant.formats import FP8Weight, IntWeight, QuantWeight
from baton.engine.quant.gguf_blocks import block_type, to_blocks

log = logging.getLogger(__name__)
ROW_BITS = 32  # a source row is encoded as prefix index << ROW_BITS | row
SPLIT_GROUP = "this rank's share of its inputs would split a quantization group"


class _Rows:
    """What a parameter's weight_loader writes into: one int64 per row (`.data`)."""

    def __init__(self, rows: int) -> None:
        self.data = torch.zeros((rows, 1), dtype=torch.int64)  # 0: no source row
        self.shape = self.data.shape


def row_sources(model: CausalLM, prefixes: list[str], rows_of: dict[str, int]
                ) -> dict[str, torch.Tensor]:
    """Our linear module -> (out,) int64: for each of its rows, the checkpoint row it holds
    (`prefix index << ROW_BITS | row`), -1 where none does. Rows travel through the loaders
    plus one, so a row a loader fills with zeros (a vocabulary padded to the ranks) reads
    as none, not as the first prefix's first row."""
    params = dict(model.named_parameters())
    holders: dict[str, _Rows] = {}
    for i, prefix in enumerate(prefixes):
        n = rows_of[prefix]
        codes = (torch.arange(n, dtype=torch.int64) | (i << ROW_BITS)).unsqueeze(1) + 1
        for pname, shard, piece in model.checkpoint_weights(f"{prefix}.weight", codes):
            param = params.get(pname)
            if param is None or not pname.endswith(".weight"):
                continue
            holder = holders.setdefault(pname, _Rows(param.shape[0]))
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    raise ValueError
                loader(holder, piece, shard)
            except (RuntimeError, ValueError, IndexError):
                if piece.shape[0] != holder.shape[0]:  # a loader that also cuts columns
                    continue
                holder.data.copy_(piece)
    return {pname.removesuffix(".weight"): h.data[:, 0] - 1 for pname, h in holders.items()}


def _runs(sources: torch.Tensor) -> list[tuple[int, int, int]]:
    """(prefix index, first row, rows) of each run of consecutive checkpoint rows."""
    runs: list[tuple[int, int, int]] = []
    for src in sources.tolist():
        prefix, row = src >> ROW_BITS, src & ((1 << ROW_BITS) - 1)
        if runs and runs[-1][0] == prefix and runs[-1][1] + runs[-1][2] == row:
            runs[-1] = (prefix, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((prefix, row, 1))
    return runs


def _rows_of(w: IntWeight, first: int, count: int) -> IntWeight:
    zeros = None if w.zeros is None else w.zeros[first:first + count]
    return IntWeight(w.codes[first:first + count], w.scales[first:first + count], zeros,
                     w.bits, w.group_size, w.g_idx)


def cpu_parts(weights: Mapping[int, QuantWeight | None], sources: torch.Tensor
              ) -> tuple[list | None, str]:
    """The (raw blocks, type) parts of one of our linears from its rows' sources, or None
    and why they cannot be served natively."""
    if bool((sources < 0).any()):
        return None, "some rows are not quantized in the checkpoint"
    parts = []
    for prefix, first, count in _runs(sources):
        w = weights[prefix]
        if w is None:
            return None, SPLIT_GROUP
        if not isinstance(w, IntWeight):
            return None, "fp8 weights have no native CPU kernel"
        qtype, why = block_type(w)
        if qtype is None:
            return None, why
        parts.append((to_blocks(_rows_of(w, first, count), qtype), qtype))
    return parts, ""


def _rank_columns(w: QuantWeight, in_features: int, tp: TPGroup) -> QuantWeight | None:
    """`w` as a linear of `in_features` inputs holds it under `tp`: whole, or this rank's
    share of its columns (a row-parallel linear) with their scales, None where a share
    would split a group or block."""
    k = w.shape[1]
    if in_features == k:
        return w
    first, n = tp.split(k, "a quantized linear's input")
    if isinstance(w, FP8Weight):
        if w.block is None:
            return FP8Weight(w.values[:, first:first + n], w.scales, None, w.input_scale)
        bk = w.block[1]
        if first % bk:
            return None
        return FP8Weight(w.values[:, first:first + n],
                         w.scales[:, first // bk:-(-(first + n) // bk)], w.block, w.input_scale)
    codes = w.codes[:, first:first + n]
    if w.g_idx is not None:  # groups by index: every scale column stays addressable
        return IntWeight(codes, w.scales, w.zeros, w.bits, w.group_size,
                         w.g_idx[first:first + n])
    if w.group_size >= k:  # one scale per row
        return IntWeight(codes, w.scales, w.zeros, w.bits, n)
    size = w.group_size
    if first % size or n % size:
        return None
    groups = slice(first // size, (first + n) // size)
    zeros = None if w.zeros is None else w.zeros[:, groups]
    return IntWeight(codes, w.scales[:, groups], zeros, w.bits, size)


def _slice_rows(w: QuantWeight, first: int, count: int) -> QuantWeight | None:
    if isinstance(w, IntWeight):
        return _rows_of(w, first, count)
    if count == w.shape[0]:
        return w
    if w.block is not None:
        if first % w.block[0] or (count % w.block[0] and first + count != w.shape[0]):
            return None  # the slice would split a block's scale
        bn = w.block[0]
        scales = w.scales[first // bn:-(-(first + count) // bn)]
    else:
        scales = w.scales.expand(w.shape[0], 1)[first:first + count]
    return FP8Weight(w.values[first:first + count], scales, w.block, w.input_scale)


def gpu_layer(weights: Mapping[int, QuantWeight | None], sources: torch.Tensor, old: nn.Linear,
              device: torch.device, dtype: torch.dtype,
              capability: tuple[int, int] | None = None) -> tuple[nn.Module | None, str]:
    """One of our linears as a GPUQuantLinear, or None and why it cannot be."""
    from baton.engine.quant.gpu_linear import GPUQuantLinear, merge_rows

    if bool((sources < 0).any()):
        return None, "some rows are not quantized in the checkpoint"
    runs = _runs(sources)
    if any(weights[p] is None for p, _, _ in runs):
        return None, SPLIT_GROUP
    parts = [_slice_rows(w, first, count) for p, first, count in runs
             if (w := weights[p]) is not None]
    merged = None if any(p is None for p in parts) else merge_rows(
        [p for p in parts if p is not None])
    if merged is None:
        return None, "its fused parts differ in format or layout"
    bias = None if old.weight.is_meta else old.bias  # before the load: set by the caller
    return GPUQuantLinear(merged, bias, device, dtype, capability), ""


def _serving_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type not in ("cpu", "cuda"):
        return f"the device is {device.type}"
    if device.type == "cpu" and dtype != torch.bfloat16:
        return f"the dtype is {dtype}, not bfloat16"
    return None


def swap_quantized_linears(model: CausalLM, model_dir: Path, device: torch.device,
                           dtype: torch.dtype, tp: TPGroup, cache_dir: Path) -> set[str]:
    """Swap (in place) the linears of `model` (this rank's slice under `tp`) that quantized
    kernels serve on `device`. `model` may still be on the meta device (before its weights
    load: the swapped linears' float weights are then never made, and their biases load
    into the new modules) or loaded. Returns the checkpoint prefixes whose weights the
    swapped modules now hold (the loader skips them); empty for an unquantized checkpoint."""
    spec = read_checkpoint_spec(model_dir)
    if spec is None:
        return set()
    why, native = _serving_reason(device, dtype), None
    if why is None and device.type == "cpu":
        from baton_cpu.quant_linear import load_quant_kernels

        native = load_quant_kernels(cache_dir)
        why = None if native is not None else "the quantized kernels cannot be built here"
    if why is not None:
        log.info("--quantization auto: %s is served de-quantized (%s)", spec.describe(), why)
        return set()
    swapped, reasons = set(), Counter[str]()
    with QuantCheckpoint(checkpoint_files(model_dir), spec) as ckpt:
        prefixes = ckpt.prefixes
        # rows from the tensors' shapes; each weight unpacked once, by the one module it
        # makes: host memory holds one linear's codes at a time, not the checkpoint's
        sources = row_sources(model, prefixes, {p: ckpt.rows(p) for p in prefixes})
        for module, rows in sources.items():
            parent_name, _, leaf = module.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, leaf)
            if not isinstance(old, nn.Linear):
                continue
            # a row-parallel linear holds this rank's columns only
            weights = {i: _rank_columns(ckpt.weight(prefixes[i]), old.in_features, tp)
                       for i in set((rows[rows >= 0] >> ROW_BITS).tolist())}
            layer, why = (_cpu_module(module, old, weights, rows, native) if native is not None
                          else gpu_layer(weights, rows, old, device, dtype))
            if layer is None:
                reasons[why] += 1
                continue
            if old.weight.is_meta and old.bias is not None:
                layer.bias = old.bias  # loaded by the checkpoint's bias, through its loader
            setattr(parent, leaf, layer)
            swapped.add(module)
    log.info("--quantization auto: %d linears of %s kept quantized (%s)%s", len(swapped),
             spec.describe(), native.isa if native is not None else "Triton / _scaled_mm",
             "".join(f"; {n} de-quantized: {why}" for why, n in reasons.items()))
    return held_prefixes(prefixes, sources, swapped)


def _cpu_module(module: str, old: nn.Linear, weights: Mapping[int, QuantWeight | None],
                rows: torch.Tensor, native) -> tuple[nn.Module | None, str]:
    parts, why = cpu_parts(weights, rows)
    return (None, why) if parts is None else (_cpu_layer(module, old, parts, native), "")


def held_prefixes(prefixes: list[str], sources: dict[str, torch.Tensor],
                  swapped: set[str]) -> set[str]:
    """The prefixes all of whose rows went into `swapped` modules."""
    kept: dict[int, bool] = {}
    for module, rows in sources.items():
        for index in set((rows[rows >= 0] >> ROW_BITS).tolist()):
            kept[index] = kept.get(index, True) and module in swapped
    return {prefixes[i] for i, held in kept.items() if held}


def _cpu_layer(module: str, old: nn.Linear, parts: list, native) -> nn.Module:
    """The QuantLinear of `parts`, checked against the weights the loader made."""
    from baton_cpu.quant_linear import QuantLinear
    from baton_cpu.quant_reference import dequantize

    if old.weight.is_meta:  # before the load: nothing to check against
        layer = QuantLinear.fused(parts, old.in_features, None, native)
    else:
        ours = torch.cat([dequantize(raw, qtype, old.in_features) for raw, qtype in parts])
        err = (ours - old.weight.float()).abs().max().item()
        if tuple(ours.shape) != tuple(old.weight.shape) or err > 1e-2 * max(
                ours.abs().max().item(), 1e-6):
            raise ValueError(f"--quantization auto: {module}'s quantized rows differ from "
                             f"the loaded weights (max error {err:.3g}); use "
                             "--quantization none")
        layer = QuantLinear.fused(parts, old.in_features, old.bias, native)
    if module == "lm_head":  # a decode batch's rows each step: the int8 path at any batch
        layer.set_dequant_rows(0)
    return layer
