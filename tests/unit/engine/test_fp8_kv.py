"""FP8 KV cache on CPU: the storage dtype and pool sizing, scales read from a checkpoint,
quantise / dequantise, the native decode and prefill kernels against a float reference on
the dequantised cache, the backend's write + read paths, and a tiny model's greedy tokens."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton import LLM, SamplingParams
from baton.engine.attention.base import BatchLayout, LayerAttention
from baton.engine.attention.kv_quant import (
    dequantize,
    kv_cache_dtype,
    quantize,
    record_kv_scale,
)
from baton.engine.attention.torch_backend import TorchAttentionBackend, windowed_attention
from baton.engine.config import EngineConfig
from baton_cpu.attention import fp8_table
from tests.unit.engine.tiny_checkpoint import save_tiny_llama

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# half an ulp of each format's mantissa (3 and 2 bits): a round trip's relative error bound
REL_ERR = {torch.float8_e4m3fn: 2 ** -4, torch.float8_e5m2: 2 ** -3}
TINY = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
PROMPTS = [[5, 17, 300, 42], list(range(10, 70)), [999, 1, 2], list(range(400, 433))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("fp8") / "tiny")


# -- dtype, sizing, scales ---------------------------------------------------------------
def test_kv_cache_dtype_names():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_args(kv_cache_dtype="int8")


def test_fp8_holds_twice_the_blocks_of_bf16(checkpoint):
    runners = {kv: LLM(str(checkpoint), dtype="bfloat16", kv_cache_dtype=kv, **TINY).engine.runner
               for kv in ("auto", "fp8", "fp8_e5m2")}
    bf16, e4m3, e5m2 = runners["auto"], runners["fp8"], runners["fp8_e5m2"]
    assert bf16.kv_cache.dtype == torch.bfloat16 and e4m3.kv_cache.dtype == FP8[0]
    assert e5m2.kv_cache.dtype == FP8[1]
    assert 2 * e4m3.bytes_per_block == bf16.bytes_per_block == 2 * e5m2.bytes_per_block
    assert e4m3.num_blocks == 2 * bf16.num_blocks == e5m2.num_blocks
    assert e4m3.kv_cache.nbytes == e4m3.num_blocks * e4m3.bytes_per_block
    f32 = LLM(str(checkpoint), dtype="float32", kv_cache_dtype="fp8", **TINY).engine.runner
    assert f32.num_blocks == e4m3.num_blocks  # a quarter of fp32's bytes per block


def test_scales_are_read_from_the_checkpoint(checkpoint, tmp_path, caplog):
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        runner = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="fp8", **TINY).engine.runner
    assert runner.kv_scales == [(0.5, 0.25), (2.0, 2.0)]
    specs = runner.model.attention_specs()
    assert [(s.k_scale, s.v_scale) for s in specs] == [(0.5, 0.25), (2.0, 2.0)]
    assert "no k_scale" not in caplog.text
    # Without an FP8 cache the scales are set aside and unused.
    plain = LLM(str(tmp_path), dtype="float32", **TINY).engine.runner
    assert plain.kv_scales == [(1.0, 1.0)] * 2


def test_missing_scales_default_to_one_with_a_warning(checkpoint, caplog):
    with caplog.at_level(logging.WARNING):
        runner = LLM(str(checkpoint), dtype="float32", kv_cache_dtype="fp8", **TINY).engine.runner
    assert runner.kv_scales == [(1.0, 1.0)] * 2
    assert sum("no k_scale / v_scale" in r.message for r in caplog.records) == 1


def test_scale_names_and_bad_scales():
    scales: dict = {}
    assert record_kv_scale(scales, "model.layers.3.self_attn.k_proj.output_scale",
                           torch.tensor(3.0))
    assert not record_kv_scale(scales, "model.layers.3.self_attn.k_proj.weight",
                               torch.ones(2, 2))
    assert scales == {(3, "k"): 3.0}
    with pytest.raises(ValueError, match="one number per layer"):
        record_kv_scale(scales, "model.layers.0.self_attn.v_scale", torch.ones(4))
    with pytest.raises(ValueError, match="not a positive scale"):
        record_kv_scale(scales, "model.layers.0.self_attn.v_scale", torch.tensor(0.0))


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_quantise_round_trip_and_saturation(dtype, scale):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 8 * scale
    x = x[x.abs() > 0.1 * scale]  # normal numbers: the relative bound holds
    back = dequantize(quantize(x, scale, dtype), scale, torch.float32)
    assert ((back - x).abs() <= REL_ERR[dtype] * x.abs() + 1e-12).all()
    big = torch.tensor([1e9, -1e9, float("inf")])
    sat = dequantize(quantize(big, scale, dtype), scale, torch.float32)
    limit = torch.finfo(dtype).max * scale
    assert torch.allclose(sat, torch.tensor([limit, -limit, limit]))
    table = fp8_table(dtype)  # the C kernels' byte -> value table
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    assert torch.equal(table.nan_to_num(7.0), values.nan_to_num(7.0))


# -- the native kernels against a float reference ------------------------------------------
def make_fp8_case(dtype, kv_dtype, H, KVH, D, seqs, bs=16, ks=0.5, vs=2.0, seed=0):
    """FP8 caches on shuffled blocks (spare blocks full of the largest value), q, and the
    layout of `seqs` (context, query) decodes-first; plus the dequantised float caches."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-(c + n) // bs) for c, n in seqs) + 5
    perm = torch.randperm(nb, generator=g).tolist()
    k32 = torch.randn(nb, bs, KVH, D, generator=g) * ks * 3
    v32 = torch.randn(nb, bs, KVH, D, generator=g) * vs
    k_cache, v_cache = quantize(k32, ks, kv_dtype), quantize(v32, vs, kv_dtype)
    tables, qsl, slots = [], [0], []
    for c, n in seqs:
        tables.append([perm.pop() for _ in range(-(-(c + n) // bs))])
        qsl.append(qsl[-1] + n)
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(c, c + n)]
    for b in perm:  # unused blocks: poison for any read past a sequence
        k_cache[b] = quantize(torch.full((bs, KVH, D), 1e9), 1.0, kv_dtype)
    width = max(len(t) for t in tables)
    layout = BatchLayout(qsl, [c for c, _ in seqs], [c + n for c, n in seqs],
                         sum(n == 1 for _, n in seqs), torch.tensor(
                             [t + [tables[0][0]] * (width - len(t)) for t in tables]),
                         torch.tensor(slots), bs)
    q = torch.randn(qsl[-1], H, D, generator=g).to(dtype)
    return q, k_cache, v_cache, layout, (dequantize(k_cache, ks, torch.float32),
                                         dequantize(v_cache, vs, torch.float32))


def reference(q, k32, v32, layout, scale):
    out = torch.empty(q.shape, dtype=torch.float32)
    KVH, D = k32.shape[2], k32.shape[3]
    for i in range(layout.num_seqs):
        n = -(-layout.seq_lens[i] // layout.block_size)
        blocks = layout.block_tables[i, :n]
        k = k32[blocks].reshape(-1, KVH, D)[: layout.seq_lens[i]]
        v = v32[blocks].reshape(-1, KVH, D)[: layout.seq_lens[i]]
        a, b = layout.query_start_loc[i], layout.query_start_loc[i + 1]
        out[a:b] = windowed_attention(q[a:b].float(), k, v, LayerAttention(scale))
    return out


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype,H,KVH,D", [(torch.bfloat16, 9, 3, 64),  # specialised
                                           (torch.bfloat16, 6, 2, 32),  # generic
                                           (torch.float32, 4, 4, 128)])
def test_native_decode_reads_fp8(native_decode, kv_dtype, dtype, H, KVH, D):
    seqs = [(300, 1), (40, 1), (15, 1), (0, 1)]
    q, kc, vc, layout, (k32, v32) = make_fp8_case(dtype, kv_dtype, H, KVH, D, seqs)
    out = torch.empty_like(q)
    native_decode(q, kc, vc, layout.block_tables, torch.tensor(layout.seq_lens), 0.125, out,
                  0.5, 2.0)
    torch.testing.assert_close(out.float(), reference(q, k32, v32, layout, 0.125),
                               **tolerance(dtype))


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype,H,KVH,D", [(torch.bfloat16, 9, 3, 64), (torch.float32, 12, 4, 80)])
@pytest.mark.parametrize("dot", [False, True])
def test_native_prefill_reads_fp8(native_prefill, kv_dtype, dtype, H, KVH, D, dot):
    if dot and not (native_prefill.has_bf16_dot and dtype == torch.bfloat16):
        pytest.skip("no AVX512-BF16 dot path for this case here")
    seqs = [(0, 37), (50, 70), (3, 1), (129, 20)]
    q, kc, vc, layout, (k32, v32) = make_fp8_case(dtype, kv_dtype, H, KVH, D, seqs)
    layout.num_decodes = 0
    rows = torch.tensor([[layout.query_start_loc[i], n, c] for i, (c, n) in enumerate(seqs)])
    out = torch.zeros_like(q)
    native_prefill.use_bf16_dot = dot
    try:
        native_prefill(q, kc, vc, layout.block_tables, rows, 0.125, out, 0.5, 2.0)
    finally:
        native_prefill.use_bf16_dot = native_prefill.has_bf16_dot
    torch.testing.assert_close(out.float(), reference(q, k32, v32, layout, 0.125),
                               **tolerance(dtype))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("kv_dtype", FP8)
def test_backend_writes_fp8_and_reads_it_back(native_decode, native_prefill, native, kv_dtype):
    """Decodes and prefill chunks through the backend: the step's K/V quantised into the
    cache, every path (native kernels or gather + SDPA / matmuls) reading what it stored."""
    H, KVH, D = 9, 3, 64
    seqs = [(40, 1), (17, 1), (0, 33), (21, 12)]
    q, kc, vc, layout, _ = make_fp8_case(torch.bfloat16, kv_dtype, H, KVH, D, seqs)
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(q.shape[0], KVH, D, generator=g) * 1.5).to(torch.bfloat16)
    v = (torch.randn(q.shape[0], KVH, D, generator=g) * 2).to(torch.bfloat16)
    spec = LayerAttention(D ** -0.5, k_scale=0.5, v_scale=2.0)
    backend = TorchAttentionBackend(torch.bfloat16, native_decode if native else None,
                                    native_prefill if native else None)
    out = backend.forward(q, k, v, kc, vc, backend.build_metadata(layout), spec)
    slots = layout.slot_mapping
    stored_k = kc.view(-1, KVH, D)[slots]
    assert torch.equal(stored_k.view(torch.uint8),
                       quantize(k, 0.5, kv_dtype).view(torch.uint8))
    k32, v32 = dequantize(kc, 0.5, torch.float32), dequantize(vc, 2.0, torch.float32)
    # The torch prefill path multiplies bf16 probabilities by bf16 values (|v| ~ 2 here).
    torch.testing.assert_close(out.float(), reference(q, k32, v32, layout, D ** -0.5),
                               atol=2e-2 if native else 4e-2, rtol=2e-2)


# -- a model end to end ------------------------------------------------------------------
def generate(checkpoint, native=True, **kw):
    llm = LLM(str(checkpoint), dtype="float32", **TINY | kw)
    if not native:
        backend = llm.engine.runner.backend
        backend.native = backend.native_prefill = None
    outs = llm.generate([list(p) for p in PROMPTS], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def test_greedy_fp8_kernels_match_the_torch_path(checkpoint):
    """Unit scales, float32 model: the native kernels and the torch path read the same FP8
    cache alike. (Agreement with a bf16 cache is measured on the bundled model: a random
    tiny model's greedy tokens flip at the slightest change.)"""
    native = generate(checkpoint, kv_cache_dtype="fp8")
    torch_path = generate(checkpoint, native=False, kv_cache_dtype="fp8")
    for (ta, la), (tb, lb) in zip(native, torch_path):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-3, rtol=0)
