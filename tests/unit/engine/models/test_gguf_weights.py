"""Reading a GGUF's linears for `--quantization auto` (`models/gguf_weights.py`,
`platforms/cpu_quant.py`): q / k rows put back in Hugging Face order, fused modules made of
their parts' rows, a type the kernels do not serve refused by name, the flag's values."""

from __future__ import annotations

import numpy as np
import pytest

from baton.engine.config import EngineConfig
from baton.engine.models.gguf_weights import GGUFLinears, unpermute_rows
from baton.engine.platforms.cpu_quant import refuse_unsupported

gguf = pytest.importorskip("gguf")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_undoes_llama_cpps_permutation():
    w = np.arange(12 * 5).reshape(12, 5)
    for heads in (1, 2, 3):
        assert (unpermute_rows(llama_cpp_permute(w, heads), heads) == w).all()


def _write(path, types: dict[str, gguf.GGMLQuantizationType]) -> None:
    """A one-layer llama GGUF (2 heads, 1 kv head, 64 wide) with these tensor types."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(2)
    w.add_head_count_kv(1)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64)}
    for name, (out, inp) in shapes.items():
        kind = types.get(name, gguf.GGMLQuantizationType.Q8_0)
        if kind == gguf.GGMLQuantizationType.Q6_K:  # bytes only: 210 per 256 elements
            data = np.zeros((out, 210 * (inp * 4) // 256), dtype=np.uint8)
            inp *= 4
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
    assert raw is not None and raw.type_name == "Q8_0" and raw.in_features == 64
    q = np.asarray(file.tensors["blk.0.attn_q.weight"].data)
    k = np.asarray(file.tensors["blk.0.attn_k.weight"].data)
    v = np.asarray(file.tensors["blk.0.attn_v.weight"].data)
    want = np.concatenate([unpermute_rows(q, 2), unpermute_rows(k, 1), v])
    assert (raw.raw.numpy() == want).all()
    assert file.linear("x", ("blk.0.attn_q.weight", "blk.9.attn_q.weight")) is None


def test_unsupported_types_are_refused_by_name(tmp_path):
    path = tmp_path / "k.gguf"
    _write(path, {"attn_v": gguf.GGMLQuantizationType.Q6_K})
    file = GGUFLinears(path)
    raws = [r for r in (file.linear(n, (f"blk.0.{n}.weight",))
                        for n in ("attn_q", "attn_v")) if r is not None]
    with pytest.raises(ValueError, match=r"Q6_K \(blk.0.attn_v.weight\)"):
        refuse_unsupported(path, raws)
    refuse_unsupported(path, raws[:1])  # Q8_0 alone is served


def test_the_flag_takes_auto_and_none():
    assert EngineConfig.from_args(quantization="auto").checkpoint.quantization == "auto"
    assert EngineConfig.from_args().checkpoint.quantization == "none"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig.from_args(quantization="int4")
