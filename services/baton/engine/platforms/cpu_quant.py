"""`--quantization auto` on CPU: a GGUF checkpoint's quantized linears served as the file
stores them (`baton_cpu.quant_linear`: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; a fused module's
parts may differ in type, as in llama.cpp's Q4_K_M), instead of the de-quantized bf16
copy the loader made. Norms and the embedding stay as loaded; a tied head becomes a
quantized linear over the file's `token_embd`.

Where the quantized kernels cannot serve (not a GGUF checkpoint, not CPU, not bfloat16,
tensor parallelism, no C compiler) the model keeps its de-quantized weights and the reason
is logged; a quantized type the kernels do not know is refused (ValueError naming it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from baton.engine.models.base import CausalLM
from baton.engine.models.gguf_weights import GGUFLinears, RawLinear, gguf_source
from baton_cpu.quant_linear import NativeQuantLinear, QuantLinear, load_quant_kernels
from baton_cpu.quant_reference import QuantType, dequantize

log = logging.getLogger(__name__)
SUPPORTED = tuple(t.name for t in QuantType)


def keep_quantized(model: CausalLM, source: str | None, device: torch.device,
                   dtype: torch.dtype, tp_size: int, cache_dir: Path) -> int:
    """Swap the model's linears (in place) for quantized ones read from the GGUF that
    `source` (a `--model` value) names; returns how many were swapped (0: none could be,
    logged). Raises ValueError for a quantized type this build cannot serve."""
    path = gguf_source(source)
    why = ("the checkpoint is not a GGUF file" if path is None
           else f"the device is {device.type}, not cpu" if device.type != "cpu"
           else f"the dtype is {dtype}, not bfloat16" if dtype != torch.bfloat16
           else "tensor parallelism is on" if tp_size != 1 else None)
    if why is not None or path is None:
        log.info("--quantization auto: the weights are served de-quantized (%s)", why)
        return 0
    file = GGUFLinears(path)
    raws = [r for r in file.linears(len(model.layers), model.cfg.tie_word_embeddings)
            if r is not None and not r.is_float]
    refuse_unsupported(path, raws)
    native = load_quant_kernels(cache_dir)
    if native is None:
        log.warning("--quantization auto: the quantized kernels cannot be built here; the "
                    "weights are served de-quantized")
        return 0
    for raw in raws:
        _swap(model, raw, native)
    log.info("--quantization auto: %d linears of %s kept quantized (%s kernels)", len(raws),
             path.name, native.isa)
    return len(raws)


def refuse_unsupported(path: Path, raws: list[RawLinear]) -> None:
    """ValueError naming every quantized type in `raws` the kernels do not serve."""
    unsupported = sorted({f"{part.type_name} ({part.sources[0]})" for r in raws
                          for part in r.parts if part.type_name not in SUPPORTED})
    if unsupported:
        raise ValueError(f"--quantization auto: {path.name} holds weights in "
                         f"{', '.join(unsupported)}; Baton serves GGUF "
                         f"{', '.join(SUPPORTED)} natively (--quantization none de-quantizes "
                         "them instead)")


def _swap(model: CausalLM, raw: RawLinear, native: NativeQuantLinear) -> None:
    """Replace `raw.module` by its QuantLinear; the first layer's are checked against the
    de-quantized weights the loader made (the name mapping and row order must agree)."""
    parts = [(part.raw, QuantType[part.type_name]) for part in raw.parts]
    parent_name, _, leaf = raw.module.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, leaf, None)
    loaded = model.embed_tokens.weight if raw.module == "lm_head" and old is None else (
        old.weight if isinstance(old, nn.Linear) else None)
    rows = sum(part.raw.shape[0] for part in raw.parts)
    if loaded is None or tuple(loaded.shape) != (rows, raw.in_features):
        raise ValueError(f"--quantization auto: {' + '.join(raw.sources)} do not fit "
                         f"{raw.module} of {model.cfg.architecture}")
    if raw.module.startswith("layers.0."):
        _check_same_weights(raw, parts, loaded)
    bias = old.bias if isinstance(old, nn.Linear) else None
    layer = QuantLinear.fused(parts, raw.in_features, bias, native)
    if raw.module == "lm_head":  # its rows are the decode batch's, each step (the layers'
        layer.set_dequant_rows(0)  # run in the one-call step): the int8 path at any batch
    setattr(parent, leaf, layer)


def _check_same_weights(raw: RawLinear, parts: list[tuple[torch.Tensor, QuantType]],
                        loaded: torch.Tensor) -> None:
    ours = torch.cat([dequantize(r, t, raw.in_features) for r, t in parts])  # (out, in) f32
    err = (ours - loaded.float()).abs().max().item()
    if err > 1e-2 * max(ours.abs().max().item(), 1e-6):
        raise ValueError(f"--quantization auto: {' + '.join(raw.sources)} de-quantized differ "
                         f"from the loaded {raw.module} (max error {err:.3g}): this GGUF "
                         "architecture's tensors are transformed in a way Baton does not "
                         "mirror; use --quantization none")
