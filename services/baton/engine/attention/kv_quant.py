"""The KV cache's storage type: the model's dtype (`auto`) or FP8 with per-layer scales.

FP8 halves a bf16 cache (a quarter of fp32), so a memory budget holds twice the blocks. As in
vLLM, each layer has a key scale and a value scale: a write stores `x / scale` saturated to
the format's largest finite value, a read computes `stored * scale`. The scales come from the
checkpoint when it has them (`model.layers.N.self_attn.k_scale` / `.v_scale`, one `.kv_scale`
for both, or llm-compressor's `k_proj.output_scale` / `v_proj.output_scale`; `load_weights`
sets them aside in `model.kv_scales`), else 1.0 with one warning. They travel to the
backends inside each layer's `LayerAttention` spec (`k_scale`, `v_scale`).

Kernels never multiply elements by a scale: q.k * k_scale folds into the softmax scale and
v_scale multiplies the output. The C kernels read FP8 through a 256-entry table per format
(`baton_cpu.attention.fp8_table`), which gives the exact value of every byte.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch

log = logging.getLogger(__name__)

# EngineConfig.kv_cache_dtype -> storage dtype ("auto": the model's dtype)
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}

_SCALE_NAME = re.compile(
    r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$"
    r"|^(?:model\.)?layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for `EngineConfig.kv_cache_dtype` `name`; ValueError if unknown."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is unknown; choose auto or one of "
                         f"{tuple(FP8_DTYPES)}")
    return FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype`, saturated to its largest finite value (FP8 has no room for the
    outliers a cast would turn into inf / NaN)."""
    limit = torch.finfo(dtype).max
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values back as `dtype`: x * scale."""
    y = x.to(torch.float32)
    return (y if scale == 1.0 else y * scale).to(dtype)


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") when checkpoint tensor `name` is a KV cache scale."""
    m = _SCALE_NAME.match(name)
    if m is None:
        return None
    layer, kind = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
    return int(layer), kind


def record_kv_scale(scales: dict[tuple[int, str], float], name: str,
                    tensor: torch.Tensor) -> bool:
    """Put `tensor` into `scales` (by (layer, "k" | "v")) if `name` is a KV scale; whether
    it was one. Raises ValueError for a scale that is not one positive finite number."""
    target = kv_scale_target(name)
    if target is None:
        return False
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; a KV "
                         "cache scale must be one number per layer (per-head scales are "
                         "not supported)")
    value = float(tensor.float().reshape(()))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"checkpoint tensor {name!r} = {value} is not a positive scale")
    layer, kind = target
    for k in ("k", "v") if kind == "kv" else (kind,):
        scales[(layer, k)] = value
    return True


def apply_kv_scales(model, kv_dtype: torch.dtype) -> list[tuple[float, float]]:
    """Give each layer's attention spec its (k_scale, v_scale) for a cache of `kv_dtype`:
    the checkpoint's (`model.kv_scales`) for FP8, 1.0 where it has none (one warning); 1.0
    everywhere for any other dtype. Returns them by layer."""
    found: dict[tuple[int, str], float] = getattr(model, "kv_scales", {}) or {}
    layers = model.layers
    if not is_fp8(kv_dtype):
        return [(1.0, 1.0)] * len(layers)
    out = [(found.get((i, "k"), 1.0), found.get((i, "v"), 1.0)) for i in range(len(layers))]
    missing = sum((i, k) not in found for i in range(len(layers)) for k in ("k", "v"))
    if missing:
        log.warning("FP8 KV cache (%s): the checkpoint has no k_scale / v_scale for %d of %d "
                    "layer scales; using 1.0 for those, which may cost accuracy",
                    str(kv_dtype).removeprefix("torch."), missing, 2 * len(layers))
    for layer, (ks, vs) in zip(layers, out):
        layer.attn.spec = dataclasses.replace(layer.attn.spec, k_scale=ks, v_scale=vs)
    return out
