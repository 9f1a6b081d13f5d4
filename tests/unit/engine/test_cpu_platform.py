"""The CPU platform (`engine/platforms/cpu.py`): a model prepared with the fused kernels
against its torch code; the one-call decode step against the Python path it replaces: the
same final hidden states and the same KV-cache writes, bit for bit, on the bundled model (a
specialised attention kernel) and on a tiny model with q/k/v biases and another head shape
(the generic kernel); padding rows; the batches it must leave to the Python path; a bad
position failing clearly with the cache untouched; the models it must leave to the Python
path."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from baton import LLM, SamplingParams
from baton.engine.attention import ForwardContext
from baton.engine.models.loader import load_model
from baton.engine.platforms.cpu import CpuPlatform
from baton.engine.platforms.cpu_layers import NativeMLP, NativeRMSNorm
from baton.engine.runner.batch import build_batch


def _tiny_biased_model(path, model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(num_hidden_layers=3, hidden_size=128, intermediate_size=320,
               num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    (path / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, path / name)


@pytest.fixture(scope="module", params=["bundled", "tiny-biased"])
def llm(request, tmp_path_factory, model_dir, kernel_cache):
    # the de-quantized bf16 linears (the GGUF's own blocks: tests/unit/engine/test_quantized_gguf.py)
    args = dict(dtype="bfloat16", block_size=16, num_kv_blocks=256, cache_dir=str(kernel_cache),
                quantization="none")
    if request.param == "bundled":
        llm = LLM(**args)
    else:
        path = tmp_path_factory.mktemp("tiny")
        _tiny_biased_model(path, model_dir)
        llm = LLM(str(path), load_format="dummy", **args)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # non-zero biases, read in place by both paths
            for layer in llm.engine.runner.model.layers:
                bias = layer.attn.qkv_proj.bias
                bias.copy_(torch.randn(bias.shape, generator=g).to(bias.dtype))
    if llm.engine.runner.platform.fast_decode is None:
        pytest.skip("the native decode step needs a C compiler")
    return llm


def _decode_batch(llm, lengths: list[int]):
    """Prefill one request per length (Python path), then schedule the next step: all decodes."""
    engine, runner = llm.engine, llm.engine.runner
    runner.platform.fast_decode, native = None, runner.platform.fast_decode
    try:
        for i, n in enumerate(lengths):
            engine.add_request(f"r{len(lengths)}-{i}", [(37 * i + 11 * j) % 4000 + 10
                                                        for j in range(n)],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in
                  list(engine.scheduler.running) + list(engine.scheduler.waiting)):
            engine.step()
    finally:
        runner.platform.fast_decode = native
    sched = engine.scheduler.schedule()
    return sched, build_batch(sched.scheduled, engine.kv.get_block_ids, runner.block_size,
                              runner.device)


def _both_paths(runner, batch):
    """(hidden, cache) after the native step and after the Python step, from one start."""
    before = runner.kv_cache.clone()
    native_hidden = runner.platform.fast_decode.run(batch)
    native_cache = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    ctx = ForwardContext(runner.backend, runner.backend.build_metadata(batch.layout),
                         runner.kv_caches)
    with torch.inference_mode():
        python_hidden = runner.model(batch.input_ids, batch.positions, ctx)
    return (native_hidden, native_cache), (python_hidden, runner.kv_cache.clone()), before


def _finish(llm, sched):
    """Hand the scheduled step back to the engine and run everything to completion."""
    engine = llm.engine
    sampled = engine.runner.execute(sched, engine.kv.get_block_ids).sampled
    engine.scheduler.update_from_output(sched, sampled)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.kv.pool.counts()[2] == 0  # no block left in use


@pytest.mark.parametrize("lengths", [[5], [17, 40, 3], [1, 16, 31, 32, 33, 64, 70, 9],
                                     [3 + 7 * i for i in range(20)]])
def test_native_step_equals_python_step_bit_for_bit(llm, lengths):
    runner = llm.engine.runner
    # Without AVX512-BF16 the native step multiplies with the portable GEMV, which serves a
    # few rows (max_rows); with the packed GEMM (max_rows None) every batch.
    lengths = lengths[:runner.platform.fast_decode.max_rows]
    sched, batch = _decode_batch(llm, lengths)
    assert runner.platform.fast_decode.can_run(batch)
    (nh, ncache), (ph, pcache), before = _both_paths(runner, batch)
    assert nh.dtype == torch.bfloat16 and nh.shape == ph.shape == (len(lengths), nh.shape[1])
    assert torch.equal(nh, ph)
    assert torch.equal(ncache, pcache)
    assert not torch.equal(ncache, before)  # the step's K/V were written
    _finish(llm, sched)


def test_padding_rows_write_nothing(llm):
    runner = llm.engine.runner
    lengths = [20, 7, 33][:runner.platform.fast_decode.max_rows]  # the rows it runs natively
    sched, batch = _decode_batch(llm, lengths)
    assert runner.platform.fast_decode.can_run(batch)
    batch.layout.slot_mapping[1] = -1  # a static-policy padding row: attends, never writes
    (nh, ncache), (ph, pcache), before = _both_paths(runner, batch)
    assert torch.equal(nh, ph) and torch.equal(ncache, pcache)
    slots = batch.layout.slot_mapping[[i for i in range(len(lengths)) if i != 1]]
    changed = (ncache != before).any(-1).any(-1).any(0).any(0)  # (blocks, block_size)
    assert sorted(changed.flatten().nonzero().squeeze(1).tolist()) == sorted(slots.tolist())
    _finish(llm, sched)


def test_prefill_and_oversized_steps_take_the_python_path(llm):
    runner = llm.engine.runner
    max_rows = runner.platform.fast_decode.max_rows  # None with the packed GEMM: any batch
    sched, batch = _decode_batch(llm, [4] * (max_rows + 1 if max_rows else 24))
    assert runner.platform.fast_decode.can_run(batch) == (max_rows is None)
    _finish(llm, sched)
    engine = llm.engine
    engine.add_request("p", list(range(10, 40)), SamplingParams(max_tokens=2))
    sched = engine.scheduler.schedule()
    prefill = build_batch(sched.scheduled, engine.kv.get_block_ids, runner.block_size,
                          runner.device)
    assert not runner.platform.fast_decode.can_run(prefill)
    _finish(llm, sched)


def test_generate_is_the_same_with_and_without_the_native_step(llm):
    """Whole runs with every kind of step (prefill chunks, mixed, 9+ and 1-8 decode rows)."""
    runner = llm.engine.runner
    prompts = [[(13 * i + 7 * j) % 3000 + 20 for j in range(5 + 9 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(12)]
    native = runner.platform.fast_decode
    with_native = llm.generate(prompts, params, use_tqdm=False)
    runner.platform.fast_decode = None
    try:
        without = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.platform.fast_decode = native
    assert ([o.outputs[0].token_ids for o in with_native]
            == [o.outputs[0].token_ids for o in without])


@pytest.mark.parametrize("bad", ["position", "slot"])
def test_an_out_of_range_position_or_slot_fails_clearly_and_writes_nothing(llm, bad):
    sched, batch = _decode_batch(llm, [6, 9])
    runner = llm.engine.runner
    if bad == "position":  # past the rotary tables
        batch.positions[1] = runner.model.rotary.cos.shape[0]
    else:  # past the cache
        batch.layout.slot_mapping[1] = runner.num_blocks * runner.block_size
    before = runner.kv_cache.clone()
    with pytest.raises(RuntimeError, match="native decode step failed"):
        runner.platform.fast_decode.run(batch)
    assert torch.equal(runner.kv_cache, before)
    _finish(llm, sched)


def test_float32_runs_keep_the_python_path(model_dir):
    llm = LLM(dtype="float32", num_kv_blocks=8)
    assert llm.engine.runner.platform.fast_decode is None


class CausalAttention:
    """Stands in for ForwardContext: one sequence prefilled from scratch, no KV cache."""

    def attention(self, layer_idx, q, k, v, spec=None):
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)  # (T, H, D)


def tiny_model(tmp_path, dtype):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=200,
               intermediate_size=344, num_hidden_layers=3, num_attention_heads=5,
               num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(tmp_path, dtype, torch.device("cpu"), 256, "dummy")
    torch.manual_seed(0)
    with torch.no_grad():  # dummy norm weights are all 1: make them exercise the multiply
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_model_matches_its_torch_code(tmp_path, dtype):
    """Packed linears, fused norms, SiLU * up and rotary against the model as loaded."""
    model = tiny_model(tmp_path, dtype)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40)
    with torch.inference_mode():
        reference = model(ids, positions, CausalAttention())
    platform = CpuPlatform(tmp_path)
    platform.prepare(model)
    if platform.ops is None:
        pytest.skip("no C compiler: the model keeps its torch code")
    assert isinstance(model.norm, NativeRMSNorm) and isinstance(model.layers[0].mlp, NativeMLP)
    assert model.rotary.kernel is platform.ops
    with torch.inference_mode():
        native = model(ids, positions, CausalAttention())
    # Differences of an ulp now and then, carried through 3 layers.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(native.float(), reference.float(), rtol=tol, atol=tol)


def test_verification_rows_are_decodes_of_the_native_step(llm):
    """A decode's last token and its speculative guesses (`engine.spec`) are laid out as one
    decode per row, each attending its own context: the one-call step runs them, the same
    bits as the Python path."""
    engine, runner = llm.engine, llm.engine.runner
    fast = runner.platform.fast_decode
    if fast.max_rows is not None and fast.max_rows < 5:
        pytest.skip("the portable GEMV serves fewer rows than a verification step")
    _decode_batch(llm, [40])  # prefilled; its decode step is not run
    req = engine.scheduler.running[-1]
    req.spec_token_ids = [5, 6, 7, 8]
    sched = engine.scheduler.schedule()
    batch = build_batch(sched.scheduled, engine.kv.get_block_ids, runner.block_size,
                        runner.device)
    assert fast.can_run(batch) and batch.layout.num_decodes == 5
    assert batch.layout.seq_lens == [45, 44, 43, 42, 41]  # longest first
    assert batch.logits_indices == [4, 3, 2, 1, 0]  # the request's rows, in its order
    (nh, ncache), (ph, pcache), _ = _both_paths(runner, batch)
    assert torch.equal(nh, ph) and torch.equal(ncache, pcache)
    _finish(llm, sched)
