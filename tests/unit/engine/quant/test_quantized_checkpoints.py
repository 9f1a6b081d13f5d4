"""Quantized safetensors checkpoints (compressed-tensors, fp8, GPTQ, AWQ): each format's
tensors read into the weights they stand for, the engine's greedy tokens equal to
transformers running those weights, `--quantization auto` serving int4 / int8 natively on
CPU within the format's tolerance, and what cannot be served refused by name."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.models.loader import checkpoint_files
from baton.engine.quant.checkpoint import QuantCheckpoint, read_checkpoint_spec
from baton.engine.quant.spec import UnsupportedQuantization, read_spec
from tests.unit.engine.quant.quant_checkpoints import (
    save_awq,
    save_compressed_tensors,
    save_fp8_blocks,
    save_gptq,
)

PROMPTS = [[5, 17, 300, 42], list(range(10, 60)), [999, 1, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
TINY = dict(skip_tokenizer_init=True, num_kv_blocks=64)
INT4_SYM = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
INT4_ASYM = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)
INT4_ASYM_TENSOR = dict(num_bits=4, type="int", symmetric=False, strategy="tensor")
INT8_ASYM_TENSOR = dict(num_bits=8, type="int", symmetric=False, strategy="tensor")
INT8_CHANNEL = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
INT8_TOKEN = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
FP8_CHANNEL = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
FP8_BLOCK = dict(num_bits=8, type="float", symmetric=True, strategy="block",
                 block_structure=[64, 64])
FP8_TOKEN = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)

CHECKPOINTS = {
    "ct-int4-g32": lambda p: save_compressed_tensors(p, "pack-quantized", INT4_SYM),
    "ct-int4-asym-g128": lambda p: save_compressed_tensors(p, "pack-quantized", INT4_ASYM),
    # one zero point per tensor (kept signed, not packed)
    "ct-int4-asym-tensor": lambda p: save_compressed_tensors(p, "pack-quantized",
                                                             INT4_ASYM_TENSOR),
    "ct-int8-asym-tensor": lambda p: save_compressed_tensors(p, "int-quantized",
                                                             INT8_ASYM_TENSOR),
    "ct-w8a8-int8": lambda p: save_compressed_tensors(p, "int-quantized", INT8_CHANNEL,
                                                      INT8_TOKEN),
    "ct-fp8-channel": lambda p: save_compressed_tensors(p, "float-quantized", FP8_CHANNEL,
                                                        FP8_TOKEN),
    "ct-fp8-block": lambda p: save_compressed_tensors(p, "float-quantized", FP8_BLOCK),
    "gptq-int4-g32": lambda p: save_gptq(p, 4, 32),
    "gptq-int4-asym-g64-act-order": lambda p: save_gptq(p, 4, 64, sym=False, desc_act=True),
    "gptq-int8-g128": lambda p: save_gptq(p, 8, 128),
    "awq-g32": lambda p: save_awq(p, 32),
    "fp8-block64": lambda p: save_fp8_blocks(p, 64),
}
NATIVE_ON_CPU = {"ct-int4-g32": 8, "ct-int4-asym-g128": 8, "ct-w8a8-int8": 8,
                 "gptq-int4-g32": 8, "gptq-int8-g128": 8, "awq-g32": 8}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (reference transformers model with the de-quantized weights, directory)."""
    root = tmp_path_factory.mktemp("quantized")
    return {name: make(root / name) for name, make in CHECKPOINTS.items()}


def greedy(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob if isinstance(lp, dict)
                                      else lp.logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def reference_greedy(model) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_each_format_reads_into_the_weights_it_stands_for(checkpoints, name):
    reference, path = checkpoints[name]
    spec = read_checkpoint_spec(path)
    with QuantCheckpoint(checkpoint_files(path), spec) as ckpt:
        assert len(ckpt.prefixes) == 14  # every linear of both layers, not the head
        ours = dict(ckpt.float_tensors())
    theirs = reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key].float(), value.float(), rtol=1e-5, atol=1e-6,
                                   msg=key)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_rows_read_from_the_tensor_shapes_are_the_unpacked_weights(checkpoints, name):
    path = checkpoints[name][1]
    with QuantCheckpoint(checkpoint_files(path), read_checkpoint_spec(path)) as ckpt:
        rows = {p: ckpt.rows(p) for p in ckpt.prefixes}
        assert rows == {p: ckpt.weight(p).shape[0] for p in ckpt.prefixes}
    assert sorted(set(rows.values())) == [64, 128, 256]  # k / v, q / o / gate / up, down


@pytest.mark.parametrize("name", ["ct-int4-asym-g128", "gptq-int4-asym-g64-act-order",
                                  "awq-g32", "fp8-block64", "ct-fp8-channel"])
def test_greedy_tokens_equal_transformers_on_the_reference_path(checkpoints, name):
    reference, path = checkpoints[name]
    llm = LLM(str(path), dtype="float32", quantization="none", **TINY)
    assert [tokens for tokens, _ in greedy(llm)] == reference_greedy(reference)


def test_transformers_reads_compressed_tensors_and_fp8_as_we_do(checkpoints):
    """Where transformers has the format's loader (compressed-tensors, fine-grained fp8
    de-quantized on a CPU), its weights are ours."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    for name in ("ct-int4-asym-g128", "ct-fp8-block"):
        reference, path = checkpoints[name]
        loaded = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(run_compressed=False))
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[key].float(), value, msg=key)
    reference, path = checkpoints["fp8-block64"]
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key].float(), value, msg=key)


@pytest.mark.parametrize("name", list(NATIVE_ON_CPU))
def test_auto_serves_int_weights_natively_on_cpu_within_tolerance(checkpoints, name):
    from baton_cpu.quant_linear import QuantLinear

    path = checkpoints[name][1]
    plain = greedy(LLM(str(path), dtype="bfloat16", quantization="none", **TINY))
    llm = LLM(str(path), dtype="bfloat16", quantization="auto", **TINY)
    quantized = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == NATIVE_ON_CPU[name]  # fused: qkv, o, gate_up, down per layer
    # The first token comes from the prefill, which de-quantizes tile by tile: the plain
    # model's weights but for the scales rounded to fp16 (exact for GPTQ's fp16 scales),
    # up to ~0.08 nats on these random weights; decode rows take int8 activations per
    # 32-block, ~0.1-0.2 nats more (their near-ties may then flip a token).
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(greedy(llm), plain, strict=True):
        assert tokens[0] == ref_tokens[0] and abs(logprobs[0] - ref_logprobs[0]) < 0.12
        for i in range(1, len(tokens)):
            if tokens[:i] != ref_tokens[:i]:
                break
            assert abs(logprobs[i] - ref_logprobs[i]) < 0.3


def test_what_has_no_native_cpu_kernel_stays_dequantized(checkpoints, caplog):
    from baton_cpu.quant_linear import QuantLinear

    caplog.set_level(logging.INFO, logger="baton.engine.quant")
    for name in ("fp8-block64", "gptq-int4-asym-g64-act-order"):
        llm = LLM(str(checkpoints[name][1]), dtype="bfloat16", quantization="auto", **TINY)
        assert not any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
        assert greedy(llm)[0][0]  # it serves
    assert "de-quantized: act-order (g_idx)" in caplog.text
    assert "fp8 weights have no native CPU kernel" in caplog.text


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit"),
    ({"quant_method": "compressed-tensors", "format": "sparse-24-bitmask",
      "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
     "float4 weights by tensor_group"),
])
def test_formats_we_do_not_serve_are_refused_by_name(config, named):
    with pytest.raises(UnsupportedQuantization, match=named):
        read_spec({"quantization_config": config})


def test_an_unserved_checkpoint_is_refused_at_start(checkpoints, tmp_path):
    import shutil

    path = shutil.copytree(checkpoints["gptq-int4-g32"][1], tmp_path / "bnb")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match="hqq"):
        LLM(str(path), dtype="float32", **TINY)


def test_tensor_parallel_shards_the_dequantized_weights(checkpoints):
    """Tensor parallelism (gloo, one child rank) over a quantized checkpoint: each rank
    loads its slice of the de-quantized weights; tokens equal transformers'."""
    reference, path = checkpoints["gptq-int4-asym-g64-act-order"]
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_threads=1, **TINY)
    try:
        assert [tokens for tokens, _ in greedy(llm)] == reference_greedy(reference)
    finally:
        llm.engine.close()


def test_tensor_parallel_serves_each_ranks_share_quantized(checkpoints):
    """--quantization auto under tensor parallelism: column-parallel linears take their rows,
    row-parallel ones their columns with those columns' groups, still GGUF blocks on CPU;
    the served logprobs stay those of one rank within the int8 activations' noise."""
    from baton_cpu.quant_linear import QuantLinear

    path = checkpoints["gptq-int4-g32"][1]
    one = greedy(LLM(str(path), dtype="bfloat16", quantization="auto", **TINY))
    llm = LLM(str(path), dtype="bfloat16", quantization="auto", tensor_parallel_size=2,
              num_threads=1, **TINY)
    try:
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 8
        assert {m.in_features for m in layers} == {128, 64}  # o_proj: half of 128 inputs
        two = greedy(llm)
    finally:
        llm.engine.close()
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(two, one, strict=True):
        assert tokens[0] == ref_tokens[0] and abs(logprobs[0] - ref_logprobs[0]) < 0.12


@pytest.mark.parametrize("name", ["gptq-int4-asym-g64-act-order", "ct-int8-channel-pack",
                                  "fp8-block64", "ct-fp8-channel"])
def test_a_ranks_share_of_columns_is_those_columns_of_the_weight(checkpoints, tmp_path, name):
    from baton.engine.distributed import TPGroup
    from baton.engine.quant.serve import _rank_columns

    path = (save_compressed_tensors(tmp_path / name, "pack-quantized", INT8_CHANNEL)[1]
            if name == "ct-int8-channel-pack" else checkpoints[name][1])
    with QuantCheckpoint(checkpoint_files(path), read_checkpoint_spec(path)) as ckpt:
        weight = ckpt.weight("model.layers.0.mlp.down_proj")  # (128, 256)
    for rank in (0, 1):
        share = _rank_columns(weight, 128, TPGroup(rank, 2))
        assert share is not None and share.shape == (128, 128)
        torch.testing.assert_close(share.dequantize(),
                                   weight.dequantize()[:, 128 * rank:128 * (rank + 1)])
    assert _rank_columns(weight, 256, TPGroup(1, 2)) is weight  # not row-parallel: whole


def test_an_fp8_kv_cache_beside_quantized_weights(checkpoints):
    from baton_cpu.quant_linear import QuantLinear

    path = checkpoints["awq-g32"][1]
    plain = greedy(LLM(str(path), dtype="bfloat16", quantization="none", kv_cache_dtype="fp8",
                       **TINY))
    llm = LLM(str(path), dtype="bfloat16", quantization="auto", kv_cache_dtype="fp8", **TINY)
    assert str(llm.engine.runner.kv_dtype) == "torch.float8_e4m3fn"
    assert sum(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules()) == 8
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(greedy(llm), plain, strict=True):
        # fp8 keys and values round the weights' fp16-scale differences up a bucket
        assert tokens[0] == ref_tokens[0] and abs(logprobs[0] - ref_logprobs[0]) < 0.3


def test_quantized_linears_are_swapped_in_before_the_load(checkpoints, tmp_path):
    """auto builds the quantized linears on the meta-device model, so their float weights
    are never made (the load peaks at the quantized size); biases load into them through
    the fused loaders; tokens as transformers' on the de-quantized weights."""
    from baton_cpu.quant_linear import QuantLinear

    reference, path = save_gptq(tmp_path / "bias", 4, 32, bias=True)
    llm = LLM(str(path), dtype="bfloat16", quantization="auto", **TINY)
    model = llm.engine.runner.model
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
    qkv = model.layers[0].attn.qkv_proj
    want = torch.cat([reference.model.layers[0].self_attn.__getattr__(f"{p}_proj").bias
                      for p in "qkv"])
    torch.testing.assert_close(qkv.bias.float(), want.float(), rtol=1e-2, atol=1e-2)
    plain = greedy(LLM(str(path), dtype="bfloat16", quantization="none", **TINY))
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(greedy(llm), plain, strict=True):
        assert tokens[0] == ref_tokens[0] and abs(logprobs[0] - ref_logprobs[0]) < 0.12


def test_a_quantized_lm_head_runs_every_batch_through_the_int8_path(tmp_path):
    """GPTQModel's `lm_head: true`: the head's rows are a decode batch's each step, so its
    QuantLinear takes the int8 path at any batch (as a GGUF head's), swapped before the
    load or after it (LoRA on)."""
    from safetensors.torch import load_file, save_file

    from baton_cpu.quant_linear import QuantLinear
    from tests.unit.engine.quant.quant_checkpoints import pack_along, rtn

    _, path = save_gptq(tmp_path / "head", 4, 32)
    tensors = load_file(str(path / "model.safetensors"))
    head = tensors.pop("lm_head.weight").float()  # (1000, 128)
    groups = torch.arange(128) // 32
    codes, scales, zeros, _ = rtn(head, 4, groups, 4, sym=True, min_zero=1)
    tensors.update({"lm_head.qweight": pack_along(codes.T, 4, dim=0),
                    "lm_head.qzeros": pack_along((zeros - 1).T & 15, 4, 1),
                    "lm_head.scales": scales.T.contiguous(),
                    "lm_head.g_idx": groups.int()})
    save_file(tensors, str(path / "model.safetensors"))
    for lora in (False, True):
        llm = LLM(str(path), dtype="bfloat16", quantization="auto", enable_lora=lora, **TINY)
        lm_head = llm.engine.runner.model.lm_head
        if lora:  # LoRA wraps the head (an adapter may adapt it)
            lm_head = lm_head.base
        assert isinstance(lm_head, QuantLinear)
        assert all(part.dequant_rows == 0 for part in lm_head._chain)
        assert greedy(llm)[0][0]  # it serves
