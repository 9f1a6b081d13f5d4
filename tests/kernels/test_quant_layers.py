"""Quantized checkpoints' linears as the GPU serves them (`engine.quant.gpu_linear`), run in
Triton's interpreter on CPU: each of our fused linears built from the checkpoint's parts
(q / k / v, gate / up) multiplies as the de-quantized weights the loader made — GPTQ with
act-order, AWQ, compressed-tensors int8, FP8 blocks (W8A8 as sm_90 runs it) and FP8
per-channel (W8A16 as sm_80 runs it)."""

from __future__ import annotations

import pytest
import torch

from baton.engine.models.loader import checkpoint_files, load_model
from baton.engine.quant.checkpoint import QuantCheckpoint, read_checkpoint_spec
from baton.engine.quant.gpu_linear import GPUQuantLinear, merge_rows
from baton.engine.quant.serve import gpu_layer, row_sources
from tests.kernels.quant_utils import assert_gemm_close
from tests.unit.engine.quant import quant_checkpoints as qc

INT8 = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
CASES = {
    "gptq-act-order": (lambda p: qc.save_gptq(p, 4, 32, sym=False, desc_act=True), None),
    "awq": (lambda p: qc.save_awq(p, 32), None),
    "ct-int8": (lambda p: qc.save_compressed_tensors(p, "int-quantized", INT8), None),
    "fp8-blocks-sm90": (lambda p: qc.save_fp8_blocks(p, 64), (9, 0)),
    "ct-fp8-channel-sm80": (lambda p: qc.save_compressed_tensors(p, "float-quantized", FP8),
                            (8, 0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_layers_multiply_as_the_dequantized_weights(name, tmp_path):
    make, capability = CASES[name]
    _, path = make(tmp_path / name)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), 512)  # de-quantized
    with QuantCheckpoint(checkpoint_files(path), read_checkpoint_spec(path)) as ckpt:
        weights = [ckpt.weight(p) for p in ckpt.prefixes]
        sources = row_sources(model, ckpt.prefixes, {p: w.shape[0] for p, w in
                                                     zip(ckpt.prefixes, weights, strict=True)})
    assert set(sources) == {f"layers.{i}.{m}" for i in (0, 1) for m in (
        "attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for module in ("layers.0.attn.qkv_proj", "layers.1.mlp.down_proj"):
        old = model.get_submodule(module)
        layer, why = gpu_layer(weights, sources[module], old, torch.device("cpu"),
                               torch.bfloat16, capability)
        if name == "gptq-act-order" and module.endswith("qkv_proj"):
            assert layer is None and "differ" in why  # q, k, v were each given their own order
            continue
        assert isinstance(layer, GPUQuantLinear), why
        rows = x[:, :old.in_features].contiguous()
        # W8A8 (sm_90 blocks) also quantizes activations: held to fp8's tolerance
        want = (rows.float() @ old.weight.float().T).to(torch.bfloat16)
        got = layer(rows)
        if capability == (9, 0):  # fp8 activations: 3 mantissa bits
            assert (got.float() - want.float()).abs().max() <= 0.08 * want.float().abs().max()
        else:
            assert_gemm_close(got, want)


def test_parts_that_cannot_share_a_call_are_not_merged():
    from baton.engine.quant.formats import FP8Weight, IntWeight

    codes = torch.zeros(64, 64, dtype=torch.uint8)
    a = IntWeight(codes, torch.ones(64, 2), None, 4, 32)
    b = IntWeight(codes, torch.ones(64, 1), None, 4, 64)  # another group size
    assert merge_rows([a, b]) is None
    assert merge_rows([a, a]).shape == (128, 64)
    fp8 = FP8Weight(torch.zeros(64, 64, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    assert merge_rows([a, fp8]) is None
    merged = merge_rows([fp8, FP8Weight(fp8.values, torch.full((1, 1), 2.0))])
    assert merged.scales.shape == (128, 1) and merged.scales[64:].eq(2).all()


def test_a_row_parallel_share_of_an_act_order_weight_multiplies_as_its_columns(tmp_path):
    """Under tensor parallelism a row-parallel rank keeps half the columns of an act-order
    GPTQ weight and every group's scales (its columns' g_idx name any of them): the GEMM
    takes scales wider than its own K's groups."""
    from baton.engine.distributed import TPGroup
    from baton.engine.quant.serve import _rank_columns

    _, path = qc.save_gptq(tmp_path / "g", 4, 32, sym=False, desc_act=True)
    with QuantCheckpoint(checkpoint_files(path), read_checkpoint_spec(path)) as ckpt:
        weight = ckpt.weight("model.layers.0.mlp.down_proj")  # (128, 256), 8 groups
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for rank in (0, 1):
        share = _rank_columns(weight, 128, TPGroup(rank, 2))
        assert share is not None and share.g_idx is not None and share.scales.shape[1] == 8
        layer = GPUQuantLinear(share, None, torch.device("cpu"), torch.bfloat16)
        want = (x.float() @ share.dequantize().T).to(torch.bfloat16)
        assert_gemm_close(layer(x), want)
