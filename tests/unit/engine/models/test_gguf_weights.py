"""Reading a GGUF's linears for `--quantization auto` (`models/gguf_weights.py`,
`platforms/cpu_quant.py`): q / k rows put back in Hugging Face order, fused modules made of
their parts' rows (parts of different types kept apart, as a Q4_K_M file's), a type the
kernels do not serve refused by name, the flag's values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.config import EngineConfig
from baton.engine.models.gguf_weights import GGUFLinears, unpermute_rows
from baton.engine.platforms.cpu_quant import refuse_unsupported
from baton_cpu.quant_reference import QuantType, quantize_k

gguf = pytest.importorskip("gguf")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_undoes_llama_cpps_permutation():
    w = np.arange(12 * 5).reshape(12, 5)
    for heads in (1, 2, 3):
        assert (unpermute_rows(llama_cpp_permute(w, heads), heads) == w).all()


def _write(path, types: dict[str, gguf.GGMLQuantizationType], width: int = 64) -> None:
    """A one-layer llama GGUF (2 heads, 1 kv head, `width` wide) with these tensor types."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(2)
    w.add_head_count_kv(1)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (64, width), "attn_k": (32, width), "attn_v": (32, width)}
    for name, (out, inp) in shapes.items():
        kind = types.get(name, gguf.GGMLQuantizationType.Q8_0)
        if kind == gguf.GGMLQuantizationType.Q5_K:  # bytes only: 176 per 256 elements
            data = np.zeros((out, 176 * inp // 256), dtype=np.uint8)
        elif kind in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
            data = quantize_k(torch.randn(out, inp), QuantType(int(kind))).numpy()
        else:
            data = gguf.quants.quantize(rng.standard_normal((out, inp)).astype(np.float32),
                                        kind)
        w.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fused_qkv_is_its_parts_rows_in_hf_order(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path, {})
    file = GGUFLinears(path)
    raw = file.linear("layers.0.attn.qkv_proj",
                      ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"))
    assert raw is not None and raw.type_names == ("Q8_0",) and raw.in_features == 64
    q = np.asarray(file.tensors["blk.0.attn_q.weight"].data)
    k = np.asarray(file.tensors["blk.0.attn_k.weight"].data)
    v = np.asarray(file.tensors["blk.0.attn_v.weight"].data)
    want = np.concatenate([unpermute_rows(q, 2), unpermute_rows(k, 1), v])
    assert (raw.parts[0].raw.numpy() == want).all()
    assert file.linear("x", ("blk.0.attn_q.weight", "blk.9.attn_q.weight")) is None


def test_mixed_types_are_parts_in_row_order(tmp_path):
    """Q4_K_M's way: q and k in Q4_K, v in Q6_K -> two parts, the Q4_K one q's rows (put
    back in HF order) then k's."""
    path = tmp_path / "km.gguf"
    k4, k6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    _write(path, {"attn_q": k4, "attn_k": k4, "attn_v": k6}, width=256)
    file = GGUFLinears(path)
    names = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")
    raw = file.linear("layers.0.attn.qkv_proj", names)
    assert raw is not None and raw.type_names == ("Q4_K", "Q6_K") and raw.sources == names
    q4, q6 = raw.parts
    q = np.asarray(file.tensors[names[0]].data)
    k = np.asarray(file.tensors[names[1]].data)
    assert (q4.raw.numpy() == np.concatenate([unpermute_rows(q, 2), unpermute_rows(k, 1)])).all()
    assert q6.raw.shape == (32, 210) and q6.sources == names[2:]
    refuse_unsupported(path, [raw])  # both served


def test_unsupported_types_are_refused_by_name(tmp_path):
    path = tmp_path / "k.gguf"
    _write(path, {"attn_v": gguf.GGMLQuantizationType.Q5_K}, width=256)
    file = GGUFLinears(path)
    raws = [r for r in (file.linear(n, (f"blk.0.{n}.weight",))
                        for n in ("attn_q", "attn_v")) if r is not None]
    with pytest.raises(ValueError, match=r"Q5_K \(blk.0.attn_v.weight\)"):
        refuse_unsupported(path, raws)
    refuse_unsupported(path, raws[:1])  # Q8_0 alone is served


def test_the_flag_takes_auto_and_none():
    assert EngineConfig.from_args(quantization="auto").checkpoint.quantization == "auto"
    assert EngineConfig.from_args().checkpoint.quantization == "auto"  # the default
    assert EngineConfig.from_args(quantization="none").checkpoint.quantization == "none"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.from_args(quantization="int4")
