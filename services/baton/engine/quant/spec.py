"""What a checkpoint's `quantization_config` (config.json) says, read into one typed spec.

Four published families are recognised, each by its `quant_method`:

- `compressed-tensors` (llm-compressor's output): `pack-quantized` (int4/int8 packed into
  int32), `int-quantized` / `naive-quantized` (int8 stored as int8), `float-quantized`
  (FP8 e4m3); weights per tensor, channel, group or block; activations static, dynamic or
  none. A config may hold several `config_groups`, each with its `targets`.
- `fp8` (transformers' fine-grained FP8, DeepSeek-style): e4m3 weights with block-wise
  `weight_scale_inv` (`weight_block_size`, usually 128 x 128), or one per-tensor scale.
- `gptq` (AutoGPTQ / GPTQModel): int4 / int8 packed into int32 along the input, zeros
  along the output, per-group scales, `desc_act` (act-order, `g_idx`).
- `awq` (AutoAWQ, GEMM layout): int4 packed along the output in AWQ's interleaved order.

Anything else (bitsandbytes, HQQ, EXL2, sparse or transformed compressed-tensors, ...) is
refused at start with its name: `UnsupportedQuantization`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Kind = Literal["int", "float"]
Strategy = Literal["tensor", "channel", "group", "block"]


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization is one Baton cannot serve (the message names it)."""


@dataclass(frozen=True)
class WeightScheme:
    """How one linear's weight is quantized: `kind` int (codes with scales and zeros) or
    float (FP8 e4m3 values with scales), `bits`, the scales' `strategy` (one per tensor,
    per output channel, per `group_size` inputs of a channel, per `block` of (out, in))."""

    kind: Kind
    bits: int
    strategy: Strategy
    symmetric: bool = True
    group_size: int | None = None
    block: tuple[int, int] | None = None
    act_order: bool = False  # GPTQ desc_act: a column's group is g_idx[column]

    def describe(self) -> str:
        how = {"group": f"group {self.group_size}",
               "block": f"block {self.block[0]}x{self.block[1]}" if self.block else "block"}
        kind = "fp8" if self.kind == "float" else f"int{self.bits}"
        return (f"{kind} {how.get(self.strategy, self.strategy)}"
                f"{'' if self.symmetric else ' asymmetric'}{' act-order' if self.act_order else ''}")


@dataclass(frozen=True)
class ActivationScheme:
    """The activations a format quantizes (W8A8): `dynamic` scales per token (or per
    token-group for block FP8), else one static scale per tensor read from the checkpoint."""

    kind: Kind
    bits: int
    dynamic: bool


@dataclass(frozen=True)
class TargetedScheme:
    """One compressed-tensors config group: the modules it `targets` ("Linear", an exact
    name, or "re:<regex>") and its schemes."""

    targets: tuple[str, ...]
    weights: WeightScheme
    activations: ActivationScheme | None = None

    def matches(self, module: str) -> bool:
        return any(t == "Linear" or t == module or
                   (t.startswith("re:") and re.match(t[3:], module) is not None)
                   for t in self.targets)


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's quantization: its `method` and `format` and the schemes by target.
    Which linears are quantized is read from the tensors themselves (`formats.py`); the
    spec says how to read them."""

    method: str  # compressed-tensors, fp8, gptq, awq
    format: str  # pack-quantized, int-quantized, naive-quantized, float-quantized, fp8, gptq, awq
    schemes: tuple[TargetedScheme, ...]
    zeros_offset: int = 0  # GPTQ v1 files store each zero minus one

    def scheme_for(self, module: str) -> TargetedScheme:
        """The scheme of `module` (a checkpoint prefix, e.g. model.layers.0.mlp.up_proj):
        an exact target, then a regex, then "Linear"."""
        ranked = sorted(self.schemes, key=lambda s: 0 if module in s.targets else
                        1 if any(t.startswith("re:") for t in s.targets) else 2)
        for scheme in ranked:
            if scheme.matches(module):
                return scheme
        raise UnsupportedQuantization(f"{self.method}: no config group targets {module}, "
                                      "which the checkpoint stores quantized")

    def describe(self) -> str:
        kinds = sorted({s.weights.describe() for s in self.schemes})
        return f"{self.method} {self.format} ({', '.join(kinds)})"


def read_spec(config: dict) -> QuantSpec | None:
    """The spec of a config.json's `quantization_config` (also under `text_config`), None
    when there is none. Raises UnsupportedQuantization naming what cannot be served."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _hf_fp8, "gptq": _gptq,
               "awq": _awq}
    if method not in readers:
        raise UnsupportedQuantization(
            f"quantization {method or qc!r} is not served; Baton loads compressed-tensors "
            "(int4/int8/fp8), fp8, gptq and awq checkpoints, and GGUF files")
    return readers[method](qc)


def _compressed_tensors(qc: dict) -> QuantSpec:
    if qc.get("sparsity_config") or qc.get("transform_config"):
        raise UnsupportedQuantization("compressed-tensors with a sparsity or transform config "
                                      "(sparse-24, QuIP / SpinQuant rotations) is not served")
    fmt = qc.get("format") or "dense"
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        group_fmt = group.get("format") or fmt
        if group_fmt != fmt:
            raise UnsupportedQuantization(f"compressed-tensors groups in several formats "
                                          f"({fmt}, {group_fmt}) are not served")
        weights = group.get("weights")
        if weights is None:
            raise UnsupportedQuantization(f"compressed-tensors group {name} quantizes only "
                                          "activations; not served")
        groups.append(TargetedScheme(tuple(group.get("targets") or ("Linear",)),
                                     _ct_weights(weights, name),
                                     _ct_activations(group.get("input_activations"))))
    if fmt not in ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized"):
        raise UnsupportedQuantization(
            f"compressed-tensors format {fmt!r} is not served (pack-quantized, int-quantized, "
            "naive-quantized and float-quantized are)")
    if not groups:
        raise UnsupportedQuantization("compressed-tensors config without config_groups")
    return QuantSpec("compressed-tensors", fmt, tuple(groups))


def _ct_weights(w: dict, group: str) -> WeightScheme:
    kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy")
    ok = (kind == "int" and bits in (4, 8)) or (kind == "float" and bits == 8)
    if not ok or strategy not in ("tensor", "channel", "group", "block"):
        raise UnsupportedQuantization(
            f"compressed-tensors group {group}: {kind}{bits} weights by {strategy} are not "
            "served (int4 / int8 / fp8 by tensor, channel, group or block are)")
    if w.get("dynamic") not in (None, False):
        raise UnsupportedQuantization(f"compressed-tensors group {group}: dynamic weight "
                                      "scales are not served")
    block = tuple(w["block_structure"]) if w.get("block_structure") else None
    return WeightScheme(kind, bits, strategy, bool(w.get("symmetric", True)),
                        w.get("group_size"), block,  # type: ignore[arg-type]
                        act_order=w.get("actorder") in ("group", "dynamic"))


def _ct_activations(a: dict | None) -> ActivationScheme | None:
    if a is None:
        return None
    return ActivationScheme(a.get("type", "int"), int(a.get("num_bits", 8)),
                            a.get("dynamic") not in (None, False))


def _hf_fp8(qc: dict) -> QuantSpec:
    block = qc.get("weight_block_size")
    weights = (WeightScheme("float", 8, "block", block=(int(block[0]), int(block[1])))
               if block else WeightScheme("float", 8, "tensor"))
    acts = ActivationScheme("float", 8, qc.get("activation_scheme", "dynamic") == "dynamic")
    return QuantSpec("fp8", "fp8", (TargetedScheme(("Linear",), weights, acts),))


def _gptq(qc: dict) -> QuantSpec:
    bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    if bits not in (4, 8):
        raise UnsupportedQuantization(f"gptq with {bits}-bit weights is not served (4, 8 are)")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"gptq checkpoint_format {fmt!r} is not served")
    weights = WeightScheme("int", bits, "group" if group > 0 else "channel",
                           bool(qc.get("sym", True)), group if group > 0 else None,
                           act_order=bool(qc.get("desc_act", False)))
    return QuantSpec("gptq", "gptq", (TargetedScheme(("Linear",), weights),),
                     zeros_offset=1 if fmt == "gptq" else 0)


def _awq(qc: dict) -> QuantSpec:
    bits, version = int(qc.get("bits", qc.get("w_bit", 4))), str(qc.get("version", "gemm"))
    if bits != 4 or version.lower() != "gemm":
        raise UnsupportedQuantization(f"awq {bits}-bit version {version!r} is not served "
                                      "(4-bit GEMM layout is)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    weights = WeightScheme("int", 4, "group", not bool(qc.get("zero_point", True)), group)
    return QuantSpec("awq", "awq", (TargetedScheme(("Linear",), weights),))
