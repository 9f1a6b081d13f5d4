"""Tiny quantized checkpoints written as each format's own tools write them, and the float
models they stand for.

compressed-tensors: quantized and packed by compressed-tensors itself (its
`apply_quantization_config` / `calculate_qparams` / `ModelCompressor`). GPTQ and AWQ (whose
tools need a GPU): round-to-nearest quantization with their published math and packing
(AutoGPTQ's `QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear`), written with their
tensor names. FP8 (transformers' fine-grained fp8): block scales as DeepSeek-V3 stores them.
Each writer returns the de-quantized weights by checkpoint name: the float reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 1000
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_model(seed: int = 0, bias: bool = False):
    """A 2-layer Llama, hidden 128 (groups of 128 fit; k and v have 64 rows); `bias`:
    q / k / v with random biases, as Qwen2-style checkpoints have (o's zero, not saved)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, initializer_range=0.2, eos_token_id=2,
                      bos_token_id=1, tie_word_embeddings=False, attention_bias=bias)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):  # q / k / v only (Qwen2's; ours has no o bias)
                p.uniform_(-0.5, 0.5) if "o_proj" not in name else p.zero_()
    return model


def linears(model):
    return [(name, mod) for name, mod in model.named_modules()
            if name.rsplit(".", 1)[-1] in LINEARS]


def reference_model(model, dequantized: dict[str, torch.Tensor]):
    """`model` with each quantized linear's weight replaced by its de-quantized one."""
    with torch.no_grad():
        for name, mod in linears(model):
            mod.weight.copy_(dequantized[name])
    return model


# -- compressed-tensors ---------------------------------------------------------------------
def save_compressed_tensors(path: Path, fmt: str, weights: dict, activations: dict | None = None,
                            seed: int = 0):
    """A compressed-tensors checkpoint (`fmt`: pack-quantized, int-quantized,
    float-quantized) quantized by compressed-tensors; returns (reference model, path)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    model = tiny_model(seed)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=None if activations is None
                                else QuantizationArgs(**activations))
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                format=fmt)
    apply_quantization_config(model, config)
    dequantized = {}
    for name, mod in linears(model):
        _ct_qparams(mod)
        args = mod.quantization_scheme.weights
        zp = getattr(mod, "weight_zero_point", None)
        with torch.no_grad():
            dequantized[name] = fake_quantize(mod.weight, mod.weight_scale, zp, args).clone()
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return reference_model(tiny_model(seed), dequantized), path


def _ct_qparams(mod) -> None:
    """The module's weight scale (and zero) from its min / max, per its strategy."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w, args = mod.weight.data, mod.quantization_scheme.weights
    if args.strategy == "group":
        w = w.reshape(w.shape[0], -1, args.group_size)  # (N, G, group)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        w = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk).transpose(1, 2).flatten(2)
    elif args.strategy == "tensor":
        w = w.reshape(1, 1, -1)
    else:
        w = w.unsqueeze(1)  # (N, 1, K)
    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
    with torch.no_grad():
        mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape).to(mod.weight_scale.dtype))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.copy_(zero.reshape(mod.weight_zero_point.shape)
                                        .to(mod.weight_zero_point.dtype))


# -- GPTQ / AWQ -----------------------------------------------------------------------------
def rtn(w: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int, sym: bool,
        min_zero: int = 0):
    """GPTQ's quantizer per group: scale = (max - min) / maxq, zero = round(-min / scale)
    (symmetric: the range +-max, zero (maxq + 1) / 2); `min_zero` 1 for GPTQ v1 files,
    which cannot store a zero of 0. w (N, K) -> codes (N, K) int,
    scales (N, G) fp16, zeros (N, G) int, de-quantized (N, K) float32."""
    maxq = (1 << bits) - 1
    n = w.shape[0]
    lo = torch.zeros(n, num_groups).scatter_reduce(1, groups.expand(n, -1), w, "amin")
    hi = torch.zeros(n, num_groups).scatter_reduce(1, groups.expand(n, -1), w, "amax")
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
    scales = ((hi - lo) / maxq).clamp(min=1e-5).half()
    zeros = (torch.full_like(lo, (maxq + 1) // 2) if sym
             else torch.round(-lo / scales.float()).clamp(min_zero, maxq))
    s, z = scales.float()[:, groups], zeros[:, groups]  # (N, K)
    codes = torch.clamp(torch.round(w / s) + z, 0, maxq)
    return codes.int(), scales, zeros.int(), (codes - z) * s


def pack_along(codes: torch.Tensor, bits: int, dim: int,
               order: tuple[int, ...] | None = None) -> torch.Tensor:
    """codes (R, C) int -> int32 words of 32 / bits codes along `dim`, low bits first;
    `order`: the code each nibble of a word holds (AWQ's interleave)."""
    per = 32 // bits
    x = codes.T if dim == 0 else codes  # pack along columns
    x = x.reshape(x.shape[0], -1, per).to(torch.int64)  # (R, C / per, per)
    if order is not None:
        x = x[:, :, list(order)]
    words = (x << (torch.arange(per) * bits)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.T.contiguous() if dim == 0 else words


def unquantized_tensors(model) -> dict[str, torch.Tensor]:
    """The model's state dict less its quantized linears' weights (which each writer adds
    in its format) and o_proj's bias (zero, not saved: Qwen2-style checkpoints have none)."""
    return {k: v for k, v in model.state_dict().items()
            if not any(f"{lin}.weight" in k for lin in LINEARS) and "o_proj.bias" not in k}


def save_gptq(path: Path, bits: int = 4, group: int = 32, sym: bool = True,
              desc_act: bool = False, seed: int = 0, bias: bool = False):
    """A GPTQ (v1) checkpoint of the tiny model: returns (reference model, path)."""
    model = tiny_model(seed, bias)
    tensors = unquantized_tensors(model)
    dequantized = {}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, mod in linears(model):
        w = mod.weight.detach().float()
        k = w.shape[1]
        perm = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).int()  # columns in act order, grouped
        codes, scales, zeros, dequantized[name] = rtn(w, bits, g_idx.long(), k // group, sym,
                                                      min_zero=1)
        tensors[f"{name}.qweight"] = pack_along(codes.T, bits, dim=0)  # (K / per, N)
        tensors[f"{name}.qzeros"] = pack_along((zeros - 1).T & ((1 << bits) - 1), bits, 1)
        tensors[f"{name}.scales"] = scales.T.contiguous()  # (G, N)
        tensors[f"{name}.g_idx"] = g_idx
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
              "desc_act": desc_act, "checkpoint_format": "gptq"}
    _save(path, model, tensors, config)
    return reference_model(tiny_model(seed, bias), dequantized), path


def save_awq(path: Path, group: int = 32, seed: int = 0):
    """An AWQ (GEMM, 4-bit, zero point) checkpoint of the tiny model."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    model = tiny_model(seed)
    tensors = unquantized_tensors(model)
    dequantized = {}
    for name, mod in linears(model):
        w = mod.weight.detach().float()
        k = w.shape[1]
        codes, scales, zeros, dequantized[name] = rtn(w, 4, torch.arange(k) // group,
                                                      k // group, sym=False)
        tensors[f"{name}.qweight"] = pack_along(codes.T, 4, dim=1, order=order)  # (K, N/8)
        tensors[f"{name}.qzeros"] = pack_along(zeros.T, 4, dim=1, order=order)  # (G, N/8)
        tensors[f"{name}.scales"] = scales.T.contiguous()  # (G, N)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    _save(path, model, tensors, config)
    return reference_model(tiny_model(seed), dequantized), path


def save_fp8_blocks(path: Path, block: int = 64, seed: int = 0):
    """A transformers fine-grained fp8 checkpoint (e4m3, `weight_scale_inv` per block)."""
    model = tiny_model(seed)
    tensors = unquantized_tensors(model)
    dequantized = {}
    for name, mod in linears(model):
        w = mod.weight.detach().float()
        n, k = w.shape
        blocks = w.reshape(n // block, block, k // block, block)
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        dequantized[name] = (q.float() * scale[:, None, :, None]).reshape(n, k)
        tensors[f"{name}.weight"] = q.reshape(n, k)
        tensors[f"{name}.weight_scale_inv"] = scale
    config = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [block, block]}
    _save(path, model, tensors, config)
    return reference_model(tiny_model(seed), dequantized), path


def _save(path: Path, model, tensors: dict, quantization_config: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
