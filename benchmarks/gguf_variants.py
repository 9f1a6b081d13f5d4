"""The bundled GGUF re-quantized to other GGUF types, for the quantized benchmark and tests
(issue 39): `Q8_0` (every Q4_1 tensor), and `Q4_K_M`, llama.cpp's mix of that name.

Q4_K_M as llama.cpp's quantizer chooses it (`llama-quant.cpp`): Q4_K everywhere, Q6_K for the
head and for attn_v and ffn_down of the "more bits" layers (the first and last eighth, and
every third between). A tensor whose rows are not whole 256-element super-blocks cannot be a K
type; llama.cpp then falls back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K). Baton does not serve
Q5_0, so here the Q4_K fallback keeps the file's own Q4_1 blocks. The bundled model is 576
wide, so only its ffn_down (1536 wide) become K types: Q4_K or Q6_K by layer, while attn_v
of the "more bits" layers becomes Q8_0 beside Q4_1 q and k.

The K types are written by `baton_cpu.quant_reference.quantize_k` (the `gguf` package can
de-quantize them but not quantize them); the others by `gguf.quants.quantize`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from baton.engine.models.loader import bundled_gguf_path

VARIANTS = ("Q8_0", "Q4_K_M")


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, width: int, layers: int) -> str:
    """The GGUF type Q4_K_M gives tensor `name` (rows `width` wide), with the fallbacks above."""
    want = "Q4_K"
    if name in ("output.weight", "token_embd.weight"):
        want = "Q6_K"
    elif name.endswith((".attn_v.weight", ".ffn_down.weight")):
        want = "Q6_K" if more_bits(int(name.split(".")[1]), layers) else "Q4_K"
    if width % 256 == 0:
        return want
    return "Q8_0" if want == "Q6_K" else "Q4_1"


def requantized_gguf(variant: str, cache: Path) -> Path:
    """The bundled GGUF with its Q4_1 tensors (and, for Q4_K_M, its Q8_0 ones) re-quantized
    as `variant` names, kept in `cache` after the first call."""
    import gguf

    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    src = bundled_gguf_path()
    dst = cache / "models" / f"{src.stem.rsplit('.', 1)[0]}.{variant}.gguf"
    if dst.exists():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.get_field("general.architecture").contents())
    layers = int(reader.get_field(f"{arch}.block_count").contents())
    tmp = dst.with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if kind.name in ("Q4_1", "Q8_0"):
            want = (q4_k_m_type(t.name, int(t.shape[0]), layers) if variant == "Q4_K_M"
                    else "Q8_0" if kind.name == "Q4_1" else kind.name)
            if want != kind.name:
                data, kind = _quantize(gguf.quants.dequantize(t.data, kind), want)
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def _quantize(w: np.ndarray, type_name: str):
    """float rows (out, in) -> (raw blocks, GGMLQuantizationType) in `type_name`."""
    import gguf

    from baton_cpu.quant_reference import QuantType, quantize_k

    kind = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_K", "Q6_K"):
        raw = quantize_k(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)),
                         QuantType[type_name])
        return raw.numpy(), kind
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), kind), kind
